"""Sampling settings -> tokens, with mlx-lm's filters and repetition penalty, and the
log-probabilities a row asked for.

`sampler()` is the engine-wide sampler (mlx-lm's filter chain, drawing from MLX's global random
state, seeded once from `seed`); `sample(lp, key)` draws one row's token from its own random
key (the same filters), so a seeded row gives the same tokens alone or among other rows.
The filters run in mlx-lm's order: top-p, min-p, top-k. Before them the logits are adjusted in
mlx-lm's order: `logit_bias` (added), the repetition penalty (mlx-lm's logits processor,
sign-aware, over the last `repetition_context_size` tokens, prompt included), then OpenAI's
presence and frequency penalties over the counts of the tokens generated so far (prompt excluded):

```
logit[j] -= frequency_penalty * count[j] + presence_penalty * (count[j] > 0)
```

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
    presence_penalty: float = 0.0  # OpenAI's: off at 0, in [-2, 2]
    frequency_penalty: float = 0.0  # OpenAI's: off at 0, in [-2, 2]
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit in [-100, 100]); a dict is taken

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
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or not -2 <= v <= 2:
                raise MlxkvError(f"--{name.replace('_', '-')} must be a number in [-2, 2] (0: off), got {v}")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))

    @property
    def penalized(self) -> bool:
        """The repetition penalty is on (the row keeps its last tokens)."""
        return self.repetition_penalty != 1

    @property
    def counted(self) -> bool:
        """A presence or frequency penalty is on (the row counts its generated tokens)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def adjusted(self) -> bool:
        """The logits change before sampling (a bias or a penalty): the row is sampled apart."""
        return self.penalized or self.counted or bool(self.logit_bias)

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

    def penalize(self, history: mx.array | None, logits: mx.array, counts: mx.array | None = None) -> mx.array:
        """(1, V) logits -> adjusted: the bias, mlx-lm's repetition penalty over `history` (the
        row's last tokens), the presence/frequency penalties over `counts` (V,) (generated tokens)."""
        if self.logit_bias:
            ids, bias = zip(*self.logit_bias)
            logits = logits.at[:, mx.array(ids, mx.int32)].add(mx.array(bias, mx.float32).astype(logits.dtype))
        if self.penalized and history is not None and history.size:
            logits = make_repetition_penalty(self.repetition_penalty, self.repetition_context_size)(history, logits)
        if self.counted and counts is not None:
            logits = logits - (self.frequency_penalty * counts + self.presence_penalty * (counts > 0)).astype(logits.dtype)
        return logits


def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """{id: bias} or (id, bias) pairs -> sorted pairs, checked (ids >= 0, biases in [-100, 100])."""
    pairs = bias.items() if isinstance(bias, dict) else bias
    out = {}
    for tok, b in pairs:
        if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
            raise MlxkvError(f"--logit-bias token ids must be integers >= 0, got {tok!r}")
        if not isinstance(b, (int, float)) or isinstance(b, bool) or not math.isfinite(b) or not -100 <= b <= 100:
            raise MlxkvError(f"--logit-bias values must be numbers in [-100, 100], got {b!r} for token {tok}")
        out[tok] = float(b)
    return tuple(sorted(out.items()))


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
