"""Sampling settings -> tokens, with mlx-lm's filters and repetition penalty, and the
log-probabilities a row asked for.

`sampler()` is the engine-wide sampler (mlx-lm's filter chain, drawing from MLX's global random
state, seeded once from `seed`); `sample(lp, key)` draws one row's token from its own random
key (the same filters), so a seeded row gives the same tokens alone or among other rows.
The filters run in mlx-lm's order: top-p, min-p, top-k. The repetition penalty is mlx-lm's
logits processor (sign-aware, over the last `repetition_context_size` tokens, prompt included).

Log-probabilities (`logprobs=N`) ride with the sampled tokens in one int32 array, so a decode
step still reads back once:

```
row b:  [token, chosen_lp, id_1 .. id_N, lp_1 .. lp_N]     the lps are float32 bits
```
They are the model's own distribution (before penalty, filters and temperature).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, categorical_sampling, make_repetition_penalty

from ..errors import MlxkvError
from .constrain import ConstraintSpec

MAX_LOGPROBS = 100


@dataclass(frozen=True)
class SamplingConfig:
    temp: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    top_k: int = 0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    repetition_context_size: int = 20
    logprobs: int | None = None  # None: not asked; N: the chosen token's and the top N per token
    constraint: ConstraintSpec | None = None  # a JSON schema, regex or grammar the output must match

    def __post_init__(self):
        if not isinstance(self.temp, (int, float)) or not math.isfinite(self.temp) or self.temp < 0:
            raise MlxkvError(f"--temp must be a finite number >= 0, got {self.temp}")
        if not 0 < self.top_p <= 1:
            raise MlxkvError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise MlxkvError(f"--min-p must be in [0, 1), got {self.min_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise MlxkvError(f"--seed must be in [0, 2^63), got {self.seed}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise MlxkvError(f"--top-k must be an integer >= 0 (0: off), got {self.top_k}")
        p = self.repetition_penalty
        if not isinstance(p, (int, float)) or not math.isfinite(p) or p <= 0:
            raise MlxkvError(f"--repetition-penalty must be a finite number > 0 (1: off), got {p}")
        if not isinstance(self.repetition_context_size, int) or self.repetition_context_size < 1:
            raise MlxkvError(f"--repetition-context-size must be >= 1, got {self.repetition_context_size}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise MlxkvError(f"--logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1

    def filter(self, logprobs: mx.array) -> mx.array:
        """mlx-lm's filter chain (top-p, min-p, top-k) over (B, V) logprobs."""
        lp = logprobs
        if 0 < self.top_p < 1:
            lp = apply_top_p(lp, self.top_p)
        if self.min_p > 0:
            lp = apply_min_p(lp, self.min_p)
        if 0 < self.top_k < lp.shape[-1]:
            lp = apply_top_k(lp, self.top_k)
        return lp

    def sampler(self, seed: bool = True):
        if seed and self.seed is not None:
            mx.random.seed(self.seed)
        if self.temp == 0:
            return lambda logprobs: mx.argmax(logprobs, axis=-1)
        return lambda logprobs: categorical_sampling(self.filter(logprobs), self.temp)

    def sample(self, logprobs: mx.array, key: mx.array) -> mx.array:
        """One draw from `logprobs` (B, V) with its own random `key`."""
        if self.temp == 0:
            return mx.argmax(logprobs, axis=-1)
        return mx.random.categorical(self.filter(logprobs) * (1 / self.temp), key=key)

    def penalize(self, history: mx.array | None, logits: mx.array) -> mx.array:
        """mlx-lm's repetition penalty over (1, V) logits, `history` the row's last tokens."""
        if not self.penalized or history is None or history.size == 0:
            return logits
        return make_repetition_penalty(self.repetition_penalty, self.repetition_context_size)(history, logits)


# -- log-probabilities riding with the tokens ------------------------------------------
def pack_logprobs(tokens: mx.array, lp: mx.array, n: int) -> mx.array:
    """tokens (B,), logprobs (B, V) -> (B, 2 + 2n) int32: token, chosen lp, top-n ids, top-n lps."""
    lp = lp.astype(mx.float32)
    tokens = tokens.astype(mx.int32)
    parts = [tokens[:, None], mx.view(mx.take_along_axis(lp, tokens[:, None], axis=-1), mx.int32)]
    if n:
        ids = mx.argsort(-lp, axis=-1)[:, :n] if n * 8 >= lp.shape[-1] else _top(lp, n)
        parts += [ids.astype(mx.int32), mx.view(mx.take_along_axis(lp, ids, axis=-1), mx.int32)]
    return mx.concatenate(parts, axis=1)


def _top(lp: mx.array, n: int) -> mx.array:
    """The n best ids per row, best first."""
    ids = mx.argpartition(-lp, kth=n - 1, axis=-1)[:, :n]
    order = mx.argsort(-mx.take_along_axis(lp, ids, axis=-1), axis=-1)
    return mx.take_along_axis(ids, order, axis=-1)


def unpack_logprobs(row: list[int], n: int | None) -> tuple[int, dict | None]:
    """One read-back row -> (token, {"logprob", "top": [[id, lp], ...]} or None)."""
    tok = int(row[0])
    if n is None:
        return tok, None
    k = (len(row) - 2) // 2
    floats = np.array(row[1:], dtype=np.int64).astype(np.int32).view(np.float32).tolist()
    ids = row[2 : 2 + k]
    top = [[int(i), floats[1 + k + j]] for j, i in enumerate(ids[:n])]
    return tok, {"logprob": floats[0], "top": top}


def token_column(out: mx.array) -> mx.array:
    """Sampled output (B,) or packed (B, W) -> the tokens to feed next, (B, 1)."""
    return out[:, None] if out.ndim == 1 else out[:, :1]
