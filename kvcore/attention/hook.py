"""Route a model's attention through kvcore while a run lasts.

mlx-lm model files import `scaled_dot_product_attention` from `mlx_lm.models.base`; this
context manager rebinds that name in the modules a loaded model's classes live in, and
restores it on exit (contexts nest: a draft and a target model can both be inside one).
Dense keys go to mlx-lm's own function unchanged; a KVView goes to the portable blockwise
path (in a rotation codec's basis where the layer's codecs share one, see `rotated.py`).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.nn as nn
from mlx_lm.models import base as mlx_base

from ..cache.view import BatchKVView, KVView
from ..errors import MlxkvError
from ..cache.packed import PackedView
from .blockwise import batch_kv_attention, kv_attention, packed_attention
from .rotated import in_rotated_basis

_ORIGINAL = mlx_base.scaled_dot_product_attention
_ACTIVE: list["AttentionStats"] = []  # innermost context last
_REFS: dict[str, int] = {}  # module name -> contexts that patched it


@dataclass
class AttentionStats:
    compressed_calls: int = 0
    dense_calls: int = 0

    @property
    def path(self) -> str:
        return "mlxkv-blockwise" if self.compressed_calls else "mlx-fast-sdpa"


def _sdpa(queries, keys, values, cache, scale, mask, sinks=None):
    stats = _ACTIVE[-1] if _ACTIVE else AttentionStats()
    for kind, attend in ((KVView, kv_attention), (PackedView, packed_attention), (BatchKVView, batch_kv_attention)):
        if isinstance(keys, kind):
            stats.compressed_calls += 1
            return in_rotated_basis(attend, queries, keys, scale, sinks)
    stats.dense_calls += 1
    return _ORIGINAL(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)


def _attending_modules(model: nn.Module) -> list[str]:
    names = {type(m).__module__ for _, m in model.named_modules()}
    return [
        n for n in sorted(names)
        if getattr(sys.modules.get(n), "scaled_dot_product_attention", None) in (_ORIGINAL, _sdpa)
    ]


@contextmanager
def attention_context(model: nn.Module, required: bool = True):
    """Patch the model's attention for the duration of the block; yields AttentionStats."""
    names = _attending_modules(model)
    if required and not names:
        raise MlxkvError(
            f"model class {type(model).__module__} does not attend through "
            "mlx_lm.models.base.scaled_dot_product_attention; compressed KV is not supported for it"
        )
    stats = AttentionStats()
    for n in names:
        _REFS[n] = _REFS.get(n, 0) + 1
        sys.modules[n].scaled_dot_product_attention = _sdpa
    _ACTIVE.append(stats)
    try:
        yield stats
    finally:
        _ACTIVE.remove(stats)
        for n in names:
            _REFS[n] -= 1
            if not _REFS[n]:
                sys.modules[n].scaled_dot_product_attention = _ORIGINAL
