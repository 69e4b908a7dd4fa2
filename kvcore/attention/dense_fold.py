"""Decode attention over full-precision batch rows with the query heads of each KV head folded into
the query length: (B, Hq, 1, D) queries become (B, Hkv, Hq / Hkv, D) against the same (B, Hkv, L, D)
keys, so every KV head's keys and values are read once for all its query heads.

Run 20d on the H200 (llama-8b, 16 rows x 8k, bf16): MLX's one-query kernel (`sdpav_2pass`) took 597 us a
layer for 537 MB of K/V (0.9 TB/s) and 19.1 of a 25.7 ms step; it serves each query head on its own. A
decode query attends to every key the cache holds, so the fold is the same attention (each query row's
softmax is over the same keys; a padded batch's (B, 1, 1, L) mask broadcasts over the folded rows).
Opt-in until the device A/B (`scripts/gpu_session_run20e.sh`) has timed it: MLXKV_DENSE_FOLD=1 folds batch rows
on CUDA (one row stays on MLX's kernel: 2.85 TB/s at 32k), MLXKV_DENSE_FOLD=force on any backend and any rows
(tests), unset or 0: never.
"""

from __future__ import annotations

import os

import mlx.core as mx


def _setting() -> str:
    return os.environ.get("MLXKV_DENSE_FOLD", "0")


def applies(queries: mx.array, keys: mx.array, mask, sinks) -> bool:
    """Whether this dense call folds: one query per row, grouped query heads, no sinks, a mask that is None or
    an array that broadcasts over query heads; batch rows on CUDA with MLXKV_DENSE_FOLD=1 (`force`: anywhere)."""
    B, Hq, N, _ = queries.shape
    Hkv = keys.shape[1]
    if N != 1 or Hq == Hkv or Hq % Hkv or sinks is not None or isinstance(mask, str):
        return False
    if mask is not None and (mask.ndim != 4 or mask.shape[1] != 1 or mask.shape[2] != 1):
        return False
    setting = _setting()
    if setting == "force":
        return True
    if setting != "1":
        return False
    from ..backend import backend_name

    return B > 1 and backend_name() == "cuda"


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask) -> mx.array:
    """The folded call (`applies` said yes): (B, Hq, 1, Dv), as mx.fast.scaled_dot_product_attention gives."""
    B, Hq, _, D = queries.shape
    Hkv = keys.shape[1]
    q = queries.reshape(B, Hkv, Hq // Hkv, D)
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
    return out.reshape(B, Hq, 1, values.shape[-1])
