"""Decode attention over full-precision batch rows with the query heads of each KV head folded into
the query length: (B, Hq, 1, D) queries become (B, Hkv, Hq / Hkv, D) against the same (B, Hkv, L, D)
keys, so every KV head's keys and values are read once for all its query heads.

Run 20d on the H200 (llama-8b, 16 rows x 8k, bf16): MLX's one-query kernel (`sdpav_2pass`) took 597 us a
layer for 537 MB of K/V (0.9 TB/s) and 19.1 of a 25.7 ms step; it serves each query head on its own. A
decode query attends to every key the cache holds, so the fold is the same attention (each query row's
softmax is over the same keys; a padded batch's (B, 1, 1, L) mask broadcasts over the folded rows).
Where it runs: the engine's full-precision batch rows (`applies`, for the hook: `DenseBatchKVCache`; a lone
row and mlx-lm's own caches keep mlx-lm's call) and kvcore's own decode calls over K/V decoded to dense (`sdpa`:
packed and stacked batch rows, a row's portable fused call). On the CPU always: MLX 0.32.4 on this machine,
1.4-2.1x faster for the call and bit for bit the same output (float32, float16, bf16; 1-16 rows;
BENCHMARKS.md). On CUDA only with MLXKV_DENSE_FOLD=1: run 20e timed it on the H200, and though the call alone
ran 3.7x faster at 16 x 8k (one key length, timed over and over), the engine's 16 x 8k step took 69.4 ms against
28.5 without it: MLX serves several queries with cuDNN, which builds a graph for every new key length, and a
decode step's keys are one longer each step (host encode 77.6 ms a step against 15.1). One row and 4 x 32k were
slower in the call alone too (0.26x, 0.68x). Not on Metal: not measured against MLX's kernel there.
MLXKV_DENSE_FOLD=0: never; `force`: every backend, cache and row count (tests).

On CUDA (`MLXKV_DENSE_FOLD=1`) the fold now reads a batch cache's whole buffer (`whole_buffers`: whole 256-token
steps, cache/dense_batch.py), the tokens past the rows' length masked off, so the call's shapes -- cuDNN's
graph -- change once every 256 steps, not every step; and it takes padded rows only (an array mask: MLX's call
there is its one-query kernel with a mask, 1 565 us a layer at 16 x 8k in run 20e against the fold's 428), since
rows of one length now get MLX's own cuDNN decode path (no mask, whole-step buffers). Opt-in until the H200 times
it in the engine's step (`scripts/gpu_session_run23.sh`).
"""

from __future__ import annotations

import os

import mlx.core as mx

from ..cache.dense_batch import DenseBatchKVCache


def _setting() -> str:
    return os.environ.get("MLXKV_DENSE_FOLD", "")


def applies(queries: mx.array, keys: mx.array, mask, sinks, cache=None) -> bool:
    """Whether the hook's dense call folds: the engine's batch rows (`DenseBatchKVCache`: mlx-lm's own caches, a
    lone row's or a baseline's, keep mlx-lm's call) where `folds` says so."""
    if _setting() != "force" and not isinstance(cache, DenseBatchKVCache):
        return False
    return folds(queries, keys, mask, sinks)


def folds(queries: mx.array, keys: mx.array, mask, sinks) -> bool:
    """Whether a decode call over dense K/V folds: one query per row, grouped query heads, no sinks, a mask that
    is None or an array that broadcasts over query heads; where it is measured to win (the module's docstring)."""
    setting = _setting()
    B, Hq, N, _ = queries.shape
    Hkv = keys.shape[1]
    if N != 1 or Hq == Hkv or Hq % Hkv or sinks is not None or isinstance(mask, str):
        return False
    if mask is not None and (mask.ndim != 4 or mask.shape[1] != 1 or mask.shape[2] != 1):
        return False
    if setting in ("force", "0"):
        return setting == "force"
    from ..backend import backend_name

    backend = backend_name()
    return backend == "cpu" or (backend == "cuda" and setting == "1" and mask is not None)  # CUDA: padded rows


def sdpa(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask=None, sinks=None) -> mx.array:
    """mx.fast.scaled_dot_product_attention, folded where `folds` says so (kvcore's own dense decode calls)."""
    if folds(queries, keys, mask, sinks):
        return attention(queries, keys, values, scale, mask)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask, cache=None) -> mx.array:
    """The folded call (`applies` said yes): (B, Hq, 1, Dv), as mx.fast.scaled_dot_product_attention gives; over a
    batch cache's whole buffers on CUDA (and under `force`, so the CPU tests read them too)."""
    if isinstance(cache, DenseBatchKVCache) and (_setting() == "force" or _cuda()):
        keys, values, mask = whole_buffers(cache, keys, values, mask)
    B, Hq, _, D = queries.shape
    Hkv = keys.shape[1]
    q = queries.reshape(B, Hkv, Hq // Hkv, D)
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
    return out.reshape(B, Hq, 1, values.shape[-1])


def _cuda() -> bool:
    from ..backend import backend_name

    return backend_name() == "cuda"


def whole_buffers(cache: DenseBatchKVCache, keys: mx.array, values: mx.array, mask):
    """(keys, values, mask) over the cache's whole buffers: the rows' tokens and the empty tail of the last step,
    the tail masked off (a boolean mask widened with False, an additive one with its dtype's lowest value). As
    handed when `keys` is not the cache's slice of its own tokens."""
    n = keys.shape[2]
    if cache.keys is None or n != cache._idx or cache.keys.shape[2] == n:
        return keys, values, mask
    size = cache.keys.shape[2]
    if mask is None:
        mask = (mx.arange(size) < n)[None, None, None, :]
    else:
        fill = False if mask.dtype == mx.bool_ else mx.finfo(mask.dtype).min
        mask = mx.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, size - n)], constant_values=fill)
    return cache.keys, cache.values, mask
