"""Sampling settings -> a sampler over logprobs (mlx-lm's sampling utilities)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

from ..errors import MlxkvError


@dataclass(frozen=True)
class SamplingConfig:
    temp: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self):
        if not (0 <= self.temp < float("inf")):  # NaN fails every comparison
            raise MlxkvError(f"--temp must be a finite number >= 0, got {self.temp}")
        if not 0 < self.top_p <= 1:
            raise MlxkvError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise MlxkvError(f"--min-p must be in [0, 1), got {self.min_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise MlxkvError(f"--seed must be in [0, 2^63), got {self.seed}")

    def sampler(self):
        if self.seed is not None:
            mx.random.seed(self.seed)
        if self.temp == 0:
            return lambda logprobs: mx.argmax(logprobs, axis=-1)
        return make_sampler(temp=self.temp, top_p=self.top_p, min_p=self.min_p)
