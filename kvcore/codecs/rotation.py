"""Fixed, seeded orthogonal rotations of head vectors (made once per (dim, seed), cached).

- dim a power of two: a randomized Hadamard transform `x -> H (s * x)` with random signs s,
  applied with `mx.hadamard_transform` (O(d log d), orthonormal);
- otherwise: a random orthogonal matrix from the QR decomposition of a seeded Gaussian
  matrix (numpy, so every backend and platform gets the same matrix).
Either way the inverse is the transpose, exact up to float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import numpy as np


@dataclass(frozen=True, eq=False)
class Rotation:
    dim: int
    signs: mx.array | None  # (dim,) +-1 for the Hadamard form
    matrix: mx.array | None  # (dim, dim) orthogonal otherwise

    def forward(self, x: mx.array) -> mx.array:
        """x: (..., dim) -> R x (float32)."""
        x = x.astype(mx.float32)
        if self.signs is not None:
            return mx.hadamard_transform(x * self.signs)
        return x @ self.matrix.T

    def inverse(self, y: mx.array) -> mx.array:
        """y: (..., dim) -> R^T y (float32)."""
        y = y.astype(mx.float32)
        if self.signs is not None:
            return mx.hadamard_transform(y) * self.signs
        return y @ self.matrix


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
