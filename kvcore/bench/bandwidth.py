"""The device's measured memory bandwidth: the ceiling a memory-bound decode step can reach.

Two probes, each over an `n_bytes` float32 array, best of `repeats`:
- copy: an elementwise `a + 1` (reads and writes n_bytes; what the issue's "copy bandwidth" is);
- read: a matrix-vector product over the array as a matrix (reads n_bytes once, as a decode
  step's weight matmuls do; on Linux CPUs MLX's elementwise ops use one thread while the BLAS
  matrix-vector product uses every core, so the copy probe alone understates the ceiling).
The share of a decode step is taken against the larger of the two.
"""

from __future__ import annotations

import time

import mlx.core as mx


def _best(fn, repeats: int) -> float:
    mx.eval(fn())  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth(n_bytes: int = 1 << 28, repeats: int = 5) -> float:
    """Bytes per second read + written by an elementwise copy of an n_bytes array."""
    a = mx.ones((n_bytes // 4,), dtype=mx.float32)
    mx.eval(a)
    t = _best(lambda: a + 1, repeats)
    del a
    return 2 * n_bytes / t


def read_bandwidth(n_bytes: int = 1 << 28, repeats: int = 5, cols: int = 4096) -> float:
    """Bytes per second read by a matrix-vector product over an n_bytes float32 matrix."""
    w = mx.ones((n_bytes // 4 // cols, cols), dtype=mx.float32)
    x = mx.ones((cols,), dtype=mx.float32)
    mx.eval(w, x)
    t = _best(lambda: w @ x, repeats)
    del w
    return n_bytes / t


def memory_bandwidth(n_bytes: int = 1 << 28, repeats: int = 5) -> dict[str, float]:
    """{"copy", "read", "ceiling"} in bytes per second."""
    copy, read = copy_bandwidth(n_bytes, repeats), read_bandwidth(n_bytes, repeats)
    return {"copy": copy, "read": read, "ceiling": max(copy, read)}
