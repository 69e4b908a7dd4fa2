"""Lloyd–Max scalar quantizers for a standard normal variable, computed once per bit width.

Lloyd's iteration alternates the two optimality conditions of a minimum-MSE quantizer:
boundaries halfway between neighbouring centroids, each centroid the mean of N(0, 1) over
its cell, `(phi(a) - phi(b)) / (Phi(b) - Phi(a))` for the cell [a, b].
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

ITERATIONS = 4000
_erf = np.frompyfunc(math.erf, 1, 1)


def _phi(x: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _cdf(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1 + _erf(x / math.sqrt(2)).astype(np.float64))


@lru_cache(maxsize=None)
def gaussian_codebook(bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(centroids (2**bits,), boundaries (2**bits - 1,)) for N(0, 1), sorted, float64."""
    n = 2**bits
    # start near the optimum: the asymptotically best point density is proportional to
    # pdf^(1/3), i.e. equal-mass cells of N(0, 3)
    c = np.sort(np.array([math.sqrt(6) * _erfinv(2 * (i + 0.5) / n - 1) for i in range(n)]))
    for _ in range(ITERATIONS):
        b = (c[1:] + c[:-1]) / 2
        edges = np.concatenate([[-np.inf], b, [np.inf]])
        lo, hi = edges[:-1], edges[1:]
        mass = np.maximum(_cdf(hi) - _cdf(lo), 1e-300)
        new = (_phi(lo) - _phi(hi)) / mass
        if np.max(np.abs(new - c)) < 1e-12:
            c = new
            break
        c = new
    return c, (c[1:] + c[:-1]) / 2


def expected_mse(bits: int) -> float:
    """E[(x - Q(x))^2] for x ~ N(0, 1) under `gaussian_codebook(bits)` (by quadrature)."""
    c, b = gaussian_codebook(bits)
    x = np.linspace(-9, 9, 200001)
    q = c[np.searchsorted(b, x)]
    w = _phi(x)
    return float(np.sum((x - q) ** 2 * w) / np.sum(w))


def _erfinv(y: float) -> float:
    """Inverse of math.erf by bisection (only used to seed the iteration)."""
    lo, hi = -6.0, 6.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if math.erf(mid) < y:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
