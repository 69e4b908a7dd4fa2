"""Admission memory: the KV budget, and what a batch of rows needs under it (the byte model)."""

from __future__ import annotations

import os
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..cache.bytes import KVByteModel

# beyond weights and KV, a run holds one prefill chunk's activations and one layer's attention
# scratch at a time; the default budget leaves this much of the working set to them
TRANSIENT_SHARE = 0.10
TRANSIENT_MIN = 256 * 2**20


def working_set() -> int:
    """The GPU's recommended working set (Metal), 90% of its memory (CUDA), or half of RAM (CPU)."""
    if mx.default_device() != mx.cpu:
        info = mx.device_info()
        if "max_recommended_working_set_size" in info:  # Metal
            return int(info["max_recommended_working_set_size"])
        total = info.get("memory_size") or info.get("total_memory") or 0  # CUDA reports total_memory
        return int(int(total) * 0.9)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2)


def model_bytes(model: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def transient_bytes(total: int) -> int:
    """The named transient: activations of a prefill chunk and one layer's scratch."""
    return max(TRANSIENT_MIN, int(total * TRANSIENT_SHARE))


def default_kv_budget(weights: int = 0) -> int:
    """KV gets the working set less the weights and the named transient (never below 0)."""
    total = working_set()
    return max(0, total - weights - transient_bytes(total))


def dtype_size(model: nn.Module) -> int:
    """Bytes of one full-precision KV element: the model's floating-point parameter dtype."""
    return next((p.dtype.size for _, p in tree_flatten(model.parameters())
                 if mx.issubdtype(p.dtype, mx.floating)), 2)


def batch_need(config: dict, plans: list, model: nn.Module, policy, chunk: int = 512,
               paged: bool | None = None) -> Callable[[list[int]], int]:
    """lengths (final tokens per row) -> bytes the batch's caches may take (byte model); `paged`: as
    the runner's AttentionConfig keeps batch rows (None: its default here)."""
    model_ = KVByteModel(config, plans, dtype_size(model), policy.rollback or 0, mlxkv=policy.active, chunk=chunk,
                         paged=paged)
    return model_.batch_need
