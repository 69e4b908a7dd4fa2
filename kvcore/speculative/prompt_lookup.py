"""Prompt lookup: draft by matching the row's last tokens against its own context.

The longest suffix of the context (max_ngram down to min_ngram tokens) that occurred
earlier proposes the tokens that followed it (the latest occurrence with a full run of
followers, else the latest). No second model; a row with no match drafts nothing.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..errors import MlxkvError
from .drafts import DraftProvider, Proposal, register_draft


@register_draft("prompt-lookup")
class PromptLookup(DraftProvider):
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise MlxkvError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, contexts: list[list[int]], caps: list[int]) -> Proposal:
        return Proposal([lookup(c, k, self.max_ngram, self.min_ngram) for c, k in zip(contexts, caps)])

    def describe(self) -> dict:
        return {"draft": self.name, "max_ngram": self.max_ngram, "min_ngram": self.min_ngram}

    @classmethod
    def from_job(cls, opts, job, target) -> "PromptLookup":
        return cls(max_ngram=opts.max_ngram)


def lookup(context: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the context's last n tokens."""
    L = len(context)
    if k <= 0 or L < 2:
        return []
    a = np.asarray(context)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        windows = sliding_window_view(a[: L - 1], n)  # starts 0 .. L-1-n: never the suffix itself
        hits = np.flatnonzero((windows == a[L - n :]).all(axis=1))
        if hits.size:
            full = hits[hits + n + k <= L]
            s = int(full[-1] if full.size else hits[-1])
            return a[s + n : s + n + k].tolist()
    return []
