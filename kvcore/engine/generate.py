"""One row's generation on caches the caller owns (gpt-fast's loop): prefill, then decode.

Used where a single row continues from caches built elsewhere (a loaded cache file, a chat's
previous turns). Token finishing (EOS, stop strings, length) is the Sequence's, as in the batch
engine.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Iterator

import mlx.core as mx
import mlx.nn as nn

from ..adapter_set import select_rows
from .engine import GenerateConfig
from .forward import forward, prefill
from .runner import sample_row, with_logprobs
from .sampling import token_column
from .sequence import Completion, Request, Sequence

__all__ = ["Completion", "GenerateConfig", "Request", "decode_tokens", "generate_one"]


def decode_tokens(model: nn.Module, caches: list, logits: mx.array, sample: Callable, n: int,
                  pipelined: bool = True) -> Iterator:
    """Sample from `logits` (1, V), then keep feeding each sampled token back; yields n read-back
    samples (a token id, or a packed row with its logprobs: `Sequence.take` reads either).

    The next step is queued (async_eval) before the current token is read back. Not `pipelined`
    (a constrained row: the next mask needs this token), the next forward is queued right after
    the read-back and its sampling built once the caller took the token, so the mask is computed
    while that forward runs.
    """
    y = sample(logits)
    if pipelined:
        mx.async_eval(y)
    for i in range(n):
        nxt = None
        if pipelined and i + 1 < n:
            nxt = sample(forward(model, token_column(y), caches)[:, -1, :])
            mx.async_eval(nxt)
        elif i + 1 < n:
            nxt = forward(model, token_column(y), caches)[:, -1, :]  # built now, queued after the read-back
        tok = y.tolist()[0]
        if not pipelined and nxt is not None:
            mx.async_eval(nxt)
        yield tok
        y = nxt if pipelined or nxt is None else sample(nxt)


def _row_sampler(seq: Sequence) -> Callable:
    """logits (1, V) -> the row's sample (its settings, random state, penalty, logprobs)."""
    if seq.key is None:
        seq.sampling.sampler()  # seeds the global random state, as the engine-wide sampler does

    def draw(logits):
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return with_logprobs(sample_row(logits, seq, None, lp), lp, [seq])
    return draw


def generate_one(model: nn.Module, tokenizer, request: Request, caches: list,
                 config: GenerateConfig = GenerateConfig(),
                 on_text: Callable[[str], None] | None = None, held: int = 0,
                 interruptible: bool = False) -> Completion:
    """Generate one completion into `caches`; `on_text` receives text as it becomes final.

    `held`: how many of the prompt's first tokens the caches already hold (only the rest is
    prefilled and counted as prompt tokens). `interruptible`: a KeyboardInterrupt ends the row
    ("abort", with the text so far) instead of propagating.
    """
    seq = Sequence(request, tokenizer, config.sampling)
    select_rows(model, [request])  # its LoRA adapter, where the model holds several
    feed = list(request.prompt_ids[held:])
    seq.out.prompt_tokens = len(feed)
    try:
        memory = config.prefill_memory
        with memory.bound(len(request.prompt_ids) + request.max_tokens) if memory and len(feed) > config.prefill_chunk \
                else nullcontext():
            logits = prefill(model, feed, caches, config.prefill_chunk)
            mx.eval(logits)
        seq.started()
        if not seq.finished:
            for tok in decode_tokens(model, caches, logits, _row_sampler(seq), request.max_tokens,
                                     seq.constraint is None):
                event = seq.take(tok)
                if on_text and event.text:
                    on_text(event.text)
                if seq.finished:
                    break
        if not seq.finished:
            seq.finish("length")
    except KeyboardInterrupt:
        if not interruptible:
            raise
        event = seq.finish("abort")
        if on_text and event.text:
            on_text(event.text)
    return seq.out
