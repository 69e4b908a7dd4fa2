"""Fixed, seeded orthogonal rotations of head vectors (made once per (dim, seed), cached).

- dim a power of two: a randomized Hadamard transform `x -> H (s * x)` with random signs s,
  applied with `mx.hadamard_transform` (O(d log d), orthonormal);
- otherwise: a random orthogonal matrix from the QR decomposition of a seeded Gaussian
  matrix (numpy, so every backend and platform gets the same matrix).
Either way the inverse is the transpose, exact up to float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, partial

import mlx.core as mx
import numpy as np


@dataclass(frozen=True, eq=False)
class Rotation:
    dim: int
    signs: mx.array | None  # (dim,) +-1 for the Hadamard form
    matrix: mx.array | None  # (dim, dim) orthogonal otherwise

    def forward(self, x: mx.array) -> mx.array:
        """x: (..., dim) -> R x (float32)."""
        if self.signs is not None:
            return mx.hadamard_transform(_signed(x, self.signs))
        return x.astype(mx.float32) @ self.matrix.T

    def inverse(self, y: mx.array, dtype: mx.Dtype = mx.float32) -> mx.array:
        """y: (..., dim) -> R^T y (float32, or rounded once to `dtype`)."""
        y = y if y.dtype == mx.float32 else y.astype(mx.float32)
        if self.signs is not None:
            return _signed_as(mx.hadamard_transform(y), self.signs, dtype)
        return (y @ self.matrix).astype(dtype)


@partial(mx.compile, shapeless=True)
def _signed(x: mx.array, signs: mx.array) -> mx.array:
    return x.astype(mx.float32) * signs  # one node for the widening and the signs (exact either way)


@lru_cache(maxsize=None)
def _signed_to(dtype: mx.Dtype):
    """Compiled (shape-free): y * signs rounded once to `dtype`."""
    return mx.compile(lambda y, signs: (y * signs).astype(dtype), shapeless=True)


def _signed_as(y: mx.array, signs: mx.array, dtype: mx.Dtype) -> mx.array:
    return y * signs if dtype == mx.float32 else _signed_to(dtype)(y, signs)


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@lru_cache(maxsize=None)
def make_rotation(dim: int, seed: int = 0) -> Rotation:
    rng = np.random.default_rng([seed, dim])
    if _is_power_of_two(dim):
        signs = rng.choice(np.array([-1.0, 1.0], dtype=np.float32), size=dim)
        return Rotation(dim, mx.array(signs), None)
    q, r = np.linalg.qr(rng.standard_normal((dim, dim)))
    q = q * np.sign(np.diag(r))[None]  # Haar-distributed: fix the signs QR leaves free
    return Rotation(dim, None, mx.array(q.astype(np.float32)))
