"""Model forward passes over a cache list: chunked prefill and one decode step.

Before each forward pass, layers whose conversion is due are converted one at a time and
materialized before the next (streaming: the transient is one layer), and a prefill chunk
that would cross a conversion start is split there, so what a query sees never depends on
the chunk size.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..cache import BatchCompressedKVCache, CompressedKVCache
from ..transient import default_prefill_chunk

DEFAULT_PREFILL_CHUNK = default_prefill_chunk()  # mlx-lm's 2048; kvcore.transient.plan_prefill for a budget


def compressed(caches: list) -> list[CompressedKVCache]:
    """Every CompressedKVCache, batch rows included (conversion is row-local)."""
    out = []
    for c in caches:
        if isinstance(c, BatchCompressedKVCache):
            out.extend(c.live_rows)
        elif isinstance(c, CompressedKVCache):
            out.append(c)
    return out


def convert_due(caches: list) -> int:
    """Convert, layer by layer, every cache whose start has been reached; returns how many."""
    n = 0
    for c in compressed(caches):
        if c.pending_conversion:
            c.convert()
            mx.eval(c.state)
            n += 1
    return n


def next_boundary(caches: list, pos: int) -> int | None:
    """The first conversion start after `pos`, if any layer still has one ahead."""
    starts = [c.start for c in compressed(caches) if c.start is not None and not c.converted and c.start > pos]
    return min(starts) if starts else None


def before_conversion(pos: int, n: int, boundary: int | None) -> int:
    """How many of `n` tokens starting at cache position `pos` one pass feeds: all of them, or
    those before `boundary` (the next conversion start), so the conversion lands exactly there.
    Prefill, teacher-forced fidelity and speculative row feeds all split here."""
    return n if boundary is None or boundary >= pos + n else boundary - pos


def cache_offset(caches: list) -> int:
    for c in caches:
        if hasattr(c, "offset"):
            return int(c.offset)
    return 0


def forward(model: nn.Module, tokens: mx.array, caches: list) -> mx.array:
    """tokens: (1, N) -> logits (1, N, vocab), after converting layers that are due."""
    convert_due(caches)
    return model(tokens, cache=caches)


def prefill_chunk(model: nn.Module, tokens: list[int], caches: list, done: int,
                  chunk: int = DEFAULT_PREFILL_CHUNK) -> tuple[int, mx.array]:
    """Feed one chunk of `tokens` from index `done`; returns (new done, logits (1, n, vocab)).

    The chunk ends early at a conversion start so the conversion position is exact. Only the
    last position's logits are meaningful to callers (the prompt's last chunk returns n = 1).
    """
    pos = cache_offset(caches)
    for c in compressed(caches):
        c.reserve(pos + len(tokens) - done)  # the buffers grow once for the whole prompt
    end = done + before_conversion(pos, min(chunk, len(tokens) - done), next_boundary(caches, pos))
    if end == len(tokens) and end - done > 1:
        # the prompt's last chunk: only its last position's logits are needed, so the rest goes
        # first with its logits never evaluated (no (n, vocab) matmul, no (n, vocab) transient)
        forward(model, mx.array(tokens[done : end - 1])[None], caches)
        mx.eval([c.state for c in caches])
        done = end - 1
    return end, forward(model, mx.array(tokens[done:end])[None], caches)


def prefill(model: nn.Module, tokens: list[int], caches: list, chunk: int = DEFAULT_PREFILL_CHUNK) -> mx.array:
    """Feed all of `tokens`; returns the last position's logits (1, vocab)."""
    if not tokens:
        raise ValueError("prefill needs at least one token")
    done = 0
    while True:
        done, logits = prefill_chunk(model, tokens, caches, done, chunk)
        if done == len(tokens):
            return logits[:, -1, :]
        del logits  # unevaluated, it would hold the last layer's cache buffers of this chunk
        mx.eval([c.state for c in caches])
