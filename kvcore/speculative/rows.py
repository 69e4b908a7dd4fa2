"""Per-row token feeds and rollback over a batch's caches (speculative decoding).

Rows feed different numbers of tokens in one forward pass, padded on the RIGHT:

```
row 0:  y0 d1 d2 d3      lengths [4, 2, 1]
row 1:  y1 d1 .  .       '.' = padding: stored like a token, trimmed right after the pass
row 2:  y2 .  .  .
```
Causal attention keeps padding from reaching the real positions before it; SSM layers
(ArraysCache) are given `lengths`, so padding never enters their state.

Rollback is row-local: attention caches trim each row by its own count. SSM state cannot be
trimmed, so it is checkpointed before the tokens go in; rows that drop tokens get their
checkpoint back and feed their kept tokens again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from ..cache import BatchCompressedKVCache
from ..engine.forward import before_conversion, forward
from ..errors import MlxkvError


class RollbackError(RuntimeError):
    """A cache could not roll a row back as far as asked (e.g. a window dropped the tokens)."""


def check_caches(caches: list) -> None:
    if not _attn(caches):
        raise MlxkvError("speculative decoding needs at least one attention layer")
    for c in caches:
        if not isinstance(c, (BatchCompressedKVCache, ArraysCache)):
            raise MlxkvError(f"speculative decoding cannot roll back a {type(c).__name__} layer cache")


def _ssm(caches: list) -> list[ArraysCache]:
    return [c for c in caches if isinstance(c, ArraysCache)]


def _attn(caches: list) -> list[BatchCompressedKVCache]:
    return [c for c in caches if isinstance(c, BatchCompressedKVCache)]


def offsets(caches: list) -> list[int]:
    """Tokens each row holds (every attention layer agrees)."""
    return [int(x) for x in _attn(caches)[0].offset.tolist()]


def next_starts(caches: list) -> list[int | None]:
    """Per row: the earliest conversion start not yet converted (None: none left).

    It may lie at or before the row's offset: the next forward converts it first.
    """
    out: list[int | None] = [None] * len(offsets(caches))
    for c in _attn(caches):
        live = getattr(c, "live_rows", None)  # packed rows never convert again
        for b, r in enumerate(c.rows if live is None else live):
            if r.start is not None and not r.converted:
                out[b] = r.start if out[b] is None else min(out[b], r.start)
    return out


def boundaries(caches: list) -> list[int | None]:
    """Per row: the next conversion start strictly after its offset (None: none ahead)."""
    return [s if s is not None and s > o else None for s, o in zip(next_starts(caches), offsets(caches))]


def trim_rows(caches: list, ns: list[int]) -> None:
    """Roll each row's attention layers back by ns[row]; fails loudly if one cannot."""
    if not any(ns):
        return
    for c in _attn(caches):
        got = c.trim_rows(ns)
        if list(got) != list(ns):
            raise RollbackError(f"rollback asked {list(ns)} tokens per row, the cache gave {list(got)} "
                                "(a sliding window dropped them: build caches with a larger rollback)")


def pad(rows: list[list[int]]) -> tuple[mx.array, list[int]]:
    """Token lists -> (B, K) right-padded with 0, and the real lengths."""
    K = max(1, max(len(r) for r in rows))
    return mx.array([list(r) + [0] * (K - len(r)) for r in rows]), [len(r) for r in rows]


def feed(model: nn.Module, caches: list, tokens: mx.array, lengths: list[int]) -> mx.array:
    """tokens: (B, K), row b's real tokens first (lengths[b]) -> logits (B, K, vocab).

    The padding is trimmed again before returning; padded positions' logits are garbage.
    """
    K = tokens.shape[1]
    padded = any(n < K for n in lengths)
    ssm = _ssm(caches) if padded else []
    for c in ssm:
        c.prepare(lengths=lengths)
    logits = forward(model, tokens, caches)
    for c in ssm:
        c.finalize()
    trim_rows(caches, [K - n for n in lengths])
    return logits


def feed_lists(model: nn.Module, caches: list, rows: list[list[int]]) -> mx.array | None:
    """Feed each row its own tokens (some may have none) -> (B, vocab) logits after each
    row's last token (zeros for rows that fed nothing); None when no row had any.

    A row's tokens are split at its conversion start, as prefill splits chunks, so a start
    reached inside them converts at the exact position.
    """
    B = len(rows)
    done, last = [0] * B, [None] * B
    while any(d < len(r) for d, r in zip(done, rows)):
        pos, bounds = offsets(caches), boundaries(caches)
        chunk = []
        for b in range(B):
            rest = rows[b][done[b]:]
            chunk.append(rest[: before_conversion(pos[b], len(rest), bounds[b])])
        tokens, lengths = pad(chunk)
        logits = feed(model, caches, tokens, lengths)
        for b, n in enumerate(lengths):
            done[b] += n
            if n and done[b] == len(rows[b]):
                last[b] = logits[b, n - 1]
    live = [x for x in last if x is not None]
    if not live:
        return None
    return mx.stack([x if x is not None else mx.zeros_like(live[0]) for x in last])


@dataclass
class Checkpoint:
    """SSM states (per ArraysCache, its arrays) taken before a speculative feed."""

    states: list[tuple[ArraysCache, list]] = field(default_factory=list)

    @classmethod
    def take(cls, caches: list) -> "Checkpoint":
        return cls([(c, list(c.cache)) for c in _ssm(caches)])

    def restore(self, rows: list[bool]) -> None:
        """Give the checkpointed state back to the rows marked True."""
        sel = mx.array(rows)
        for c, saved in self.states:
            new = []
            for old, cur in zip(saved, c.cache):
                if cur is None:
                    new.append(old)
                    continue
                old = mx.zeros_like(cur) if old is None else old
                m = sel.reshape(-1, *([1] * (cur.ndim - 1)))
                new.append(mx.where(m, old, cur))
            c.cache = new


def rollback(model: nn.Module, caches: list, fed: list[list[int]], keep: list[int],
             ckpt: Checkpoint | None = None) -> int:
    """Each row keeps the first keep[b] of the tokens fed[b] it got since `ckpt`.

    Attention layers trim the rest. With SSM layers, rows that drop tokens restore the
    checkpoint and feed their kept tokens again (one more pass). Returns rows replayed.
    """
    drop = [len(f) - k for f, k in zip(fed, keep)]
    if not any(drop):
        return 0
    if ckpt is None or not ckpt.states:
        trim_rows(caches, drop)
        return 0
    replay = [d > 0 for d in drop]
    trim_rows(caches, [len(f) if r else 0 for f, r in zip(fed, replay)])
    ckpt.restore(replay)
    feed_lists(model, caches, [f[:k] if r else [] for f, k, r in zip(fed, keep, replay)])
    return sum(replay)
