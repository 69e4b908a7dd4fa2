"""Continue from caches that already hold tokens: keep the longest prefix they share with the
new context, rolling the rest back with `trim` where the caches allow it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Reuse:
    kept: int  # cached tokens the caches still hold (the context's first `kept` tokens)
    blocked: str | None = None  # why the caches could not be rolled back (then they are unusable)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _why_not_trimmable(cache) -> str:
    if not hasattr(cache, "offset"):
        return "the model keeps recurrent (SSM) state, which cannot be rolled back"
    return "a sliding window has already dropped tokens that rolling back would need"


def reuse_prefix(caches: list, cached_ids: list[int], context: list[int]) -> Reuse:
    """Trim `caches` (holding `cached_ids`) to their common prefix with `context`, leaving at
    least one context token to feed (its logits start generation)."""
    keep = min(common_prefix(cached_ids, context), len(context) - 1)
    drop = len(cached_ids) - keep
    if drop == 0:
        return Reuse(keep)
    for c in caches:
        if not c.is_trimmable():
            return Reuse(0, _why_not_trimmable(c))
    for c in caches:
        if c.trim(drop) != drop:
            return Reuse(0, _why_not_trimmable(c))
    return Reuse(keep)
