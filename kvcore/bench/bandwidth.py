"""The device's measured copy bandwidth: the ceiling a memory-bound decode step can reach."""

from __future__ import annotations

import time

import mlx.core as mx


def copy_bandwidth(n_bytes: int = 1 << 28, repeats: int = 5) -> float:
    """Bytes per second read + written by an elementwise copy of an n_bytes array."""
    a = mx.ones((n_bytes // 4,), dtype=mx.float32)
    mx.eval(a)
    mx.eval(a + 1)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(a + 1)
        best = min(best, time.perf_counter() - t0)
    del a
    return 2 * n_bytes / best
