"""Decode speed of a config: tokens per second of single-token steps over a filled cache (the median step).

The caches are filled straight from a window's captured keys and values (no prefill pass),
so timing a scheme costs its encoding and a few decode steps; one untimed step warms up.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
import mlx.nn as nn

from ..engine.forward import forward
from ..policy import KVPolicy, build_caches

STEPS = 12


def decode_tok_s(model: nn.Module, policy: KVPolicy, kv: dict[int, tuple[mx.array, mx.array]], token: int,
                 dtype: mx.Dtype, steps: int = STEPS) -> float | None:
    """Decode tok/s after filling every layer's cache with `kv[i]` = ((Hkv, T, D), (Hkv, T, Dv)); None
    when some cache-owning layer has no captured K/V (it could not be filled)."""
    caches = build_caches(model, policy)[0]
    if any(hasattr(c, "update_and_fetch") and i not in kv for i, c in enumerate(caches)):
        return None
    for i, c in enumerate(caches):
        if i in kv:
            k, v = kv[i]
            c.update_and_fetch(k[None].astype(dtype), v[None].astype(dtype))
    mx.eval([a for c in caches for a in c.state])
    x = mx.array([[token]])
    mx.eval(forward(model, x, caches))  # warm-up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        mx.eval(forward(model, x, caches))
        times.append(time.perf_counter() - t0)
    return 1 / statistics.median(times)
