"""Teacher-forced fidelity: feed a text through the real cache in chunks and compare the
next-token distributions with a full-precision reference run on the same tokens."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .attention import attention_context
from .engine.forward import forward, next_boundary, cache_offset


def teacher_forced_logprobs(model: nn.Module, tokens: list[int], caches: list, chunk: int = 64) -> mx.array:
    """Log-probabilities (T, vocab) of the next token at every position of `tokens`."""
    out, i = [], 0
    pos0 = cache_offset(caches)
    with attention_context(model, required=False):
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


def compare(ref_lp: mx.array, lp: mx.array, tokens: list[int]) -> Fidelity:
    """KL(reference || scheme) per position, agreement of argmax, perplexities on `tokens`."""
    kl = (mx.exp(ref_lp) * (ref_lp - lp)).sum(axis=-1)[:-1]  # last position has no target
    targets = mx.array(tokens[1:])
    nll_ref = -mx.take_along_axis(ref_lp[:-1], targets[:, None], axis=-1).mean()
    nll = -mx.take_along_axis(lp[:-1], targets[:, None], axis=-1).mean()
    agree = (ref_lp[:-1].argmax(-1) == lp[:-1].argmax(-1)).mean()
    kl_sorted = mx.sort(kl)
    p99 = kl_sorted[min(len(tokens) - 2, int(0.99 * (len(tokens) - 1)))]
    return Fidelity(kl.mean().item(), p99.item(), agree.item(), mx.exp(nll_ref).item(), mx.exp(nll).item())
