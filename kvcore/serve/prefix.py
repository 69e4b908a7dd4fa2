"""Prefix reuse across requests: the compressed caches of admitted prompts, kept in a RAM LRU
bounded by bytes and looked up by the longest common token prefix.

```
store(seq):   its prompt is in -> copy every layer's (state, meta_state) under its prompt ids
restore(seq): on admission -> the entry sharing the longest prefix with its prompt, copied into
              fresh caches, trimmed to the shared tokens (kvcore.engine.reuse); prefill goes on
              from there (seq.done_prompt)
```
A second chat turn starts with the first turn's prompt, so it prefills only the reply and the new
message. Entries are copies: the running rows mutate their own caches, never an entry.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from ..engine.reuse import common_prefix, reuse_prefix

MIN_REUSE = 4  # fewer shared tokens than this (a BOS, a template's header): prefill from scratch


@dataclass
class Entry:
    layers: list  # per layer: (state arrays, meta_state)
    nbytes: int


def _arrays(state) -> tuple:
    return tuple(state) if isinstance(state, (tuple, list)) else (state,)


def _copy(state):
    """Independent arrays (in the container the cache hands out: SSM caches take a list)."""
    out = [mx.array(a) if isinstance(a, mx.array) else a for a in _arrays(state)]
    return out if isinstance(state, list) else tuple(out)


class PrefixCache:
    def __init__(self, capacity: int, new_caches: Callable[[], list]):
        self.capacity, self.new_caches = capacity, new_caches
        self.entries: OrderedDict[tuple[int, ...], Entry] = OrderedDict()
        self.nbytes = 0
        self.hits = self.lookups = self.reused_tokens = 0
        self.reused: dict[str, int] = {}  # request id -> prompt tokens it reused (read once by the server)

    # -- the engine's hooks -----------------------------------------------------------
    def restore(self, seq) -> None:
        ids = list(seq.request.prompt_ids)
        self.lookups += 1
        key = max(self.entries, key=lambda k: common_prefix(k, ids), default=None)
        if key is None or min(common_prefix(key, ids), len(ids) - 1) < MIN_REUSE:
            return
        caches = self.new_caches()
        for c, (state, meta) in zip(caches, self.entries[key].layers):
            c.state = _copy(state)
            c.meta_state = meta
        reuse = reuse_prefix(caches, list(key), ids)
        if reuse.blocked or reuse.kept < MIN_REUSE:
            return
        self.entries.move_to_end(key)
        seq.caches, seq.done_prompt = caches, reuse.kept
        self.hits += 1
        self.reused_tokens += reuse.kept
        self.reused[seq.id] = reuse.kept

    def store(self, seq) -> None:
        key = tuple(seq.request.prompt_ids)
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        layers = [(_copy(c.state), c.meta_state) for c in seq.caches]
        arrays = [a for state, _ in layers for a in state if isinstance(a, mx.array)]
        mx.eval(arrays)
        nbytes = sum(a.nbytes for a in arrays)
        if nbytes > self.capacity:
            return
        self.entries[key] = Entry(layers, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.capacity:
            _, old = self.entries.popitem(last=False)
            self.nbytes -= old.nbytes
