"""Sampling settings -> a sampler over logprobs (mlx-lm's sampling utilities).

`sampler()` is the engine-wide sampler (mlx-lm's, drawing from MLX's global random state,
seeded once from `seed`); `sample(lp, key)` draws one row's token from its own random key
(the same filters), so a seeded row gives the same tokens alone or among other rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_p, make_sampler

from ..errors import MlxkvError


@dataclass(frozen=True)
class SamplingConfig:
    temp: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self):
        if not isinstance(self.temp, (int, float)) or not math.isfinite(self.temp) or self.temp < 0:
            raise MlxkvError(f"--temp must be a finite number >= 0, got {self.temp}")
        if not 0 < self.top_p <= 1:
            raise MlxkvError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise MlxkvError(f"--min-p must be in [0, 1), got {self.min_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise MlxkvError(f"--seed must be in [0, 2^63), got {self.seed}")

    def sampler(self, seed: bool = True):
        if seed and self.seed is not None:
            mx.random.seed(self.seed)
        if self.temp == 0:
            return lambda logprobs: mx.argmax(logprobs, axis=-1)
        return make_sampler(temp=self.temp, top_p=self.top_p, min_p=self.min_p)

    def sample(self, logprobs: mx.array, key: mx.array) -> mx.array:
        """One draw from `logprobs` (B, V) with its own random `key`."""
        if self.temp == 0:
            return mx.argmax(logprobs, axis=-1)
        lp = logprobs
        if 0 < self.top_p < 1:
            lp = apply_top_p(lp, self.top_p)
        if self.min_p > 0:
            lp = apply_min_p(lp, self.min_p)
        return mx.random.categorical(lp * (1 / self.temp), key=key)
