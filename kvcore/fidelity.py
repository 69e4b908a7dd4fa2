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

from .engine.forward import forward, next_boundary, cache_offset


def teacher_forced_logprobs(model: nn.Module, tokens: list[int], caches: list, chunk: int = 64) -> mx.array:
    """Log-probabilities (T, vocab) of the next token at every position of `tokens`."""
    out, i = [], 0
    pos0 = cache_offset(caches)
    while i < len(tokens):
        end = min(i + chunk, len(tokens))
        b = next_boundary(caches, pos0 + i)
        if b is not None and b < pos0 + end:
            end = b - pos0
        logits = forward(model, mx.array(tokens[i:end])[None], caches)[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(lp)
        out.append(lp)
        i = end
    return mx.concatenate(out, axis=0)


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
    ref, cur = ref_lp[:-1].astype(mx.float32), lp[:-1].astype(mx.float32)
    kl = (mx.exp(ref) * (ref - cur)).sum(axis=-1)  # (T-1,)
    targets = mx.array(tokens[1:])[:, None]
    nll_ref = -mx.take_along_axis(ref, targets, axis=-1)[:, 0]
    nll = -mx.take_along_axis(cur, targets, axis=-1)[:, 0]
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
