"""Teacher-forced fidelity: feed a text through the real cache in chunks and compare the
next-token distributions with a full-precision reference run on the same tokens.

Per position t (predicting token t+1), with p the reference and q the scheme's distribution:
KL(p || q) = sum_v p_v (log p_v - log q_v), top-1 agreement argmax p == argmax q, and the
negative log-likelihood of the true next token under each. `TokenStats` keeps those per
position so several windows pool into one `Fidelity` (mean and 99th percentile over all).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..engine.forward import (
    before_conversion,
    cache_offset,
    compressed,
    forward,
    next_boundary,
)


def _chunks(model: nn.Module, tokens: list[int], caches: list, chunk: int):
    """(start, end, log-probabilities (end - start, vocab)) per teacher-forced chunk, each chunk
    ending early at a conversion start (as the engine's prefill does)."""
    i = 0
    pos0 = cache_offset(caches)
    for c in compressed(caches):
        c.reserve(pos0 + len(tokens))  # the buffers grow once for the whole text
    while i < len(tokens):
        pos = pos0 + i
        end = i + before_conversion(pos, min(chunk, len(tokens) - i), next_boundary(caches, pos))
        logits = forward(model, mx.array(tokens[i:end])[None], caches)[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(lp)
        yield i, end, lp
        i = end


def teacher_forced_logprobs(model: nn.Module, tokens: list[int], caches: list, chunk: int = 64) -> mx.array:
    """Log-probabilities (T, vocab) of the next token at every position of `tokens`."""
    return mx.concatenate([lp for _, _, lp in _chunks(model, tokens, caches, chunk)], axis=0)


def teacher_forced_stats(model: nn.Module, tokens: list[int], caches: list, ref_lp: mx.array,
                         chunk: int = 64) -> TokenStats:
    """`token_stats(ref_lp, teacher_forced_logprobs(...), tokens)`, chunk by chunk: the scheme's
    (T, vocab) log-probabilities never exist at once (one chunk's do)."""
    parts = []
    for i, end, lp in _chunks(model, tokens, caches, chunk):
        stop = min(end, len(tokens) - 1)  # the last position has no next token
        if stop > i:
            parts.append(_stats(ref_lp[i:stop], lp[: stop - i], tokens[i + 1 : stop + 1]))
    return TokenStats(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("kl", "agree", "nll_ref", "nll")))


def teacher_forced_chunk(model: nn.Module, config: dict, tokens: int, budget: int | None = None) -> int:
    """The chunk a teacher-forced run of `tokens` tokens uses when none is given: the largest
    (up to mlx-lm's 2048) whose transient, every position's float32 logits included, fits
    `budget` (default: the device's working set) beside the weights and the window's
    full-precision KV (`kvcore.transient.plan_prefill`)."""
    from ..cache.bytes import KVByteModel
    from ..engine.memory import dtype_size, model_bytes, working_set
    from ..policy import KVPolicy
    from ..policy.plan import plan_layers
    from ..transient import plan_prefill

    size = dtype_size(model)
    kv = KVByteModel(config, plan_layers(model, KVPolicy()), size, mlxkv=False).row_alloc(tokens)
    budget = working_set() if budget is None else budget
    return plan_prefill(config, KVPolicy(), tokens, model_bytes(model), kv, budget, size, logits=True).chunk


@dataclass
class Fidelity:
    mean_kl: float
    p99_kl: float
    top1_agreement: float
    ppl_reference: float
    ppl: float

    def to_json(self) -> dict:
        return {k: round(v, 6) for k, v in self.__dict__.items()}


@dataclass
class TokenStats:
    """Per predicted position of one window (T - 1 of them): float64 numpy arrays."""

    kl: np.ndarray
    agree: np.ndarray  # 1.0 where the argmaxes agree
    nll_ref: np.ndarray
    nll: np.ndarray


def token_stats(ref_lp: mx.array, lp: mx.array, tokens: list[int]) -> TokenStats:
    """ref_lp, lp: (T, vocab) log-probabilities of the same T tokens; the last has no target."""
    return _stats(ref_lp[:-1], lp[:-1], tokens[1:])


def _stats(ref: mx.array, cur: mx.array, targets: list[int]) -> TokenStats:
    """Per position of ref, cur (n, vocab) predicting `targets` (n tokens)."""
    ref, cur = ref.astype(mx.float32), cur.astype(mx.float32)
    kl = (mx.exp(ref) * (ref - cur)).sum(axis=-1)  # (n,)
    t = mx.array(targets)[:, None]
    nll_ref = -mx.take_along_axis(ref, t, axis=-1)[:, 0]
    nll = -mx.take_along_axis(cur, t, axis=-1)[:, 0]
    agree = ref.argmax(-1) == cur.argmax(-1)
    mx.eval(kl, nll_ref, nll, agree)
    f64 = lambda a: np.array(a.astype(mx.float32), dtype=np.float64)  # noqa: E731
    return TokenStats(f64(kl), f64(agree), f64(nll_ref), f64(nll))


def pool(stats: list[TokenStats]) -> Fidelity:
    """One Fidelity over every position of every window."""
    kl = np.concatenate([s.kl for s in stats])
    nll_ref = np.concatenate([s.nll_ref for s in stats]).mean()
    nll = np.concatenate([s.nll for s in stats]).mean()
    agree = np.concatenate([s.agree for s in stats]).mean()
    return Fidelity(float(kl.mean()), float(np.percentile(kl, 99)), float(agree),
                    float(np.exp(nll_ref)), float(np.exp(nll)))


def compare(ref_lp: mx.array, lp: mx.array, tokens: list[int]) -> Fidelity:
    """KL(reference || scheme) per position, agreement of argmax, perplexities on `tokens`."""
    return pool([token_stats(ref_lp, lp, tokens)])
