"""Room for a decode step's tokens, made before the step: a cache that must grow for them grows here, one layer
at a time and materialized, instead of inside the step's graph, where every layer's old buffers stay beside their
new ones until the whole step is done (MLX keeps a command graph's inputs alive until it finishes).

mlxkv's caches grow through their own `make_room` (dense batch rows, a compressed layer's encoded buffer, packed
rows); mlx-lm's KVCache (a full-precision row on its own) grows here exactly as its update would (same size, same
trim), so the update that follows finds room and the stored tokens are the same.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache


def make_room(cache, n: int) -> bool:
    """Grow `cache` now if its next `n` tokens would not fit, and materialize what grew; whether it grew."""
    room = getattr(cache, "make_room", None)
    if room is not None:
        grew = room(n)
    elif type(cache) is KVCache:
        grew = _grow_kv_cache(cache, n)
    else:
        return False
    if grew:
        state = cache.state
        mx.eval([a for a in (state if isinstance(state, (tuple, list)) else [state]) if isinstance(a, mx.array)])
    return grew


def _grow_kv_cache(c: KVCache, n: int) -> bool:
    """mlx-lm's KVCache.update_and_fetch's growth for `n` tokens, without the write (its code, 0.32.x)."""
    prev = c.offset
    if c.keys is None or prev + n <= c.keys.shape[2]:
        return False
    B, H, _, Dk = c.keys.shape
    steps = (c.step + n - 1) // c.step
    new_k = mx.zeros((B, H, steps * c.step, Dk), c.keys.dtype)
    new_v = mx.zeros((B, H, steps * c.step, c.values.shape[3]), c.values.dtype)
    keys, values = c.keys, c.values
    if prev % c.step != 0:
        keys, values = keys[..., :prev, :], values[..., :prev, :]
    c.keys, c.values = mx.concatenate([keys, new_k], axis=2), mx.concatenate([values, new_v], axis=2)
    return True
