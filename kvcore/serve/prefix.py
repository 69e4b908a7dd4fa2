"""Prefix reuse across requests: the compressed caches of admitted prompts, kept in a RAM LRU
bounded by bytes and looked up by the longest common token prefix.

```
store(seq):   its prompt is in -> copy every layer's (state, meta_state) under (adapter, prompt ids)
store(seq, pages): it joined the pools (paged rows, cache/paged.py) -> pin its prompt's pages instead
restore(seq): on admission -> the entry of its adapter sharing the longest prefix with its prompt,
              copied into fresh caches, trimmed to the shared tokens (kvcore.engine.reuse); prefill
              goes on from there (seq.done_prompt), and when the row joins, it takes the entry's
              pages back (the pools' prefix index) rather than writing its own
```
Where rows page (compressed KV, full attention: the CPU and Metal default) an entry is the pages of
the pools the running rows use, pinned (a row writing into a pinned token's page copies it first): the prompt
is held once however many rows and entries share it, and storing copies nothing. Its bytes are its
pages'. When the batch empties, a pool whose free pages outnumber its pinned ones (and `compact_free`)
keeps only the pinned pages (renumbered: `renumber`), so a burst of rows does not hold memory for good. Elsewhere (full-precision KV, windows, CUDA's packed rows, recurrent state) entries are copies.
Entries are keyed by the row's LoRA adapter (Request.adapter, None for the base model) as well as
its tokens: the KV of a prompt depends on the adapter it ran under, so one is never reused for another.
A second chat turn starts with the first turn's prompt, so it prefills only the reply and the new
message. The running rows never mutate an entry.
With a disk tier (spill.py), entries RAM evicts are written to it, and a lookup that finds a
longer prefix on disk than in RAM loads that file back into RAM.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from ..engine.reuse import common_prefix, reuse_prefix
from .spill import PrefixDisk

COMPACT_FREE = 64  # free pages (of 128 tokens) an idle pool may keep beyond its pinned ones before it shrinks
MIN_REUSE = 4  # fewer shared tokens than this (a BOS, a template's header): prefill from scratch
Key = tuple  # (adapter folder or None, prompt ids)


@dataclass
class Entry:
    layers: list | None  # per layer: (state, meta_state or None: mlx-lm's caches keep everything in state)
    nbytes: int
    on_disk: bool = False  # a copy is in the disk tier already
    pages: list | None = None  # instead of `layers`: per layer (PagedRows, page ids, tokens), pinned

    def release(self) -> None:
        """Unpin its pages (the entry leaves RAM)."""
        for pool, ids, _ in self.pages or ():
            pool.unpin(ids)
        self.pages = None


def pinned(pages: list) -> Entry:
    for pool, ids, n in pages:
        pool.pin(ids, n)
    return Entry(None, sum(len(ids) * pool.page_bytes for pool, ids, _ in pages), pages=pages)


def _arrays(state) -> tuple:
    return tuple(state) if isinstance(state, (tuple, list)) else (state,)


def _copy(state):
    """Independent arrays (in the container the cache hands out: SSM caches take a list)."""
    out = [mx.array(a) if isinstance(a, mx.array) else a for a in _arrays(state)]
    return out if isinstance(state, list) else tuple(out)


def snapshot(caches: list, on_disk: bool = False) -> Entry:
    layers = [(_copy(c.state), getattr(c, "meta_state", None)) for c in caches]
    arrays = [a for state, _ in layers for a in _arrays(state) if isinstance(a, mx.array)]
    mx.eval(arrays)
    return Entry(layers, sum(a.nbytes for a in arrays), on_disk)


def fill(caches: list, entry: Entry) -> list:
    """Fresh `caches` (the runner's: its attention settings) holding a copy of `entry`."""
    for c, (state, meta) in zip(caches, entry.layers):
        c.state = _copy(state)
        if meta is not None:
            c.meta_state = meta
    return caches


class PrefixCache:
    def __init__(self, capacity: int, new_caches: Callable[[], list], disk: PrefixDisk | None = None,
                 compact_free: int = COMPACT_FREE):
        self.capacity, self.new_caches, self.disk = capacity, new_caches, disk
        self.compact_free = compact_free  # idle pools with more free pages than this (and than pinned) shrink
        self.entries: OrderedDict[Key, Entry] = OrderedDict()
        self.nbytes = 0
        self.hits = self.lookups = self.reused_tokens = self.disk_hits = 0
        self.reused: dict[str, int] = {}  # request id -> prompt tokens it reused (read once by the server)

    # -- the engine's hooks -----------------------------------------------------------
    def restore(self, seq) -> None:
        ids, adapter = list(seq.request.prompt_ids), seq.request.adapter
        self.lookups += 1
        key = max((k for k in self.entries if k[0] == adapter), key=lambda k: common_prefix(k[1], ids), default=None)
        shared = common_prefix(key[1], ids) if key is not None else 0
        entry, from_disk = self.entries.get(key), False
        if self.disk is not None and shared < len(ids) - 1:
            dkey, dshared = self.disk.best(adapter, ids)
            if dshared > shared and min(dshared, len(ids) - 1) >= MIN_REUSE:
                loaded = self.disk.load(dkey)
                if loaded is not None:
                    key, shared, entry, from_disk = dkey, dshared, snapshot(loaded, on_disk=True), True
                    self._keep(key, entry)
        if entry is None or min(shared, len(ids) - 1) < MIN_REUSE:
            return
        caches = self._caches(entry)
        reuse = reuse_prefix(caches, list(key[1]), ids)
        if reuse.blocked or reuse.kept < MIN_REUSE:
            return
        if key in self.entries:
            self.entries.move_to_end(key)
        seq.caches, seq.done_prompt = caches, reuse.kept
        self.hits += 1
        self.disk_hits += from_disk
        self.reused_tokens += reuse.kept
        self.reused[seq.id] = reuse.kept

    def store(self, seq, pages: list | None = None) -> None:
        """Keep `seq`'s prompt: a copy of its caches, or (`pages`: Runner.row_pages) its pinned pages."""
        key = (seq.request.adapter, tuple(seq.request.prompt_ids))
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        self._keep(key, pinned(pages) if pages is not None else snapshot(seq.caches))

    def renumber(self, moved: dict[int, int]) -> None:
        """The pools kept only the pinned pages, renumbered (Runner.compact): the entries follow."""
        for entry in self.entries.values():
            if entry.pages is not None:
                entry.pages = [(pool, [moved[p] for p in ids], n) for pool, ids, n in entry.pages]

    def unpool(self) -> None:
        """The pools are about to go (a row that cannot page joins, and the batch leaves pages): every
        entry of pages becomes a copy, so no entry keeps a pool alive that the rows no longer use."""
        for key, entry in list(self.entries.items()):
            if entry.pages is not None:
                copy = snapshot(self._caches(entry), entry.on_disk)
                entry.release()
                self.nbytes += copy.nbytes - entry.nbytes
                self.entries[key] = copy
        self._shrink()

    def flush(self) -> None:
        """Every entry RAM holds into the disk tier (on a clean stop), newest last."""
        for key, entry in self.entries.items():
            self._spill(key, entry)

    # -- RAM LRU and disk tier ---------------------------------------------------------
    def _keep(self, key: Key, entry: Entry) -> None:
        if entry.nbytes > self.capacity:  # beyond RAM's bound: straight to disk, if there is one
            self._spill(key, entry)
            entry.release()
            return
        self.entries[key] = entry
        self.nbytes += entry.nbytes
        self._shrink()

    def _shrink(self) -> None:
        """The oldest entries out of RAM (to the disk tier, if any) until the rest fit the bound."""
        while self.nbytes > self.capacity and self.entries:
            old_key, old = self.entries.popitem(last=False)
            self.nbytes -= old.nbytes
            self._spill(old_key, old)
            old.release()

    def _caches(self, entry: Entry) -> list:
        """Fresh one-row caches holding a copy of `entry` (its pages gathered)."""
        if entry.pages is not None:
            return [pool.gather_row(ids, n) for pool, ids, n in entry.pages]
        return fill(self.new_caches(), entry)

    def _spill(self, key: Key, entry: Entry) -> None:
        if self.disk is not None and not entry.on_disk:
            caches = self._caches(entry)
            size = entry.nbytes if entry.pages is None else sum(c.nbytes for c in caches)  # its tokens, not whole pages
            self.disk.save(key, caches, size)
            entry.on_disk = True
