"""PagedRows: the rows of a batch cache in pages of one pool per layer, for decode.

```
pool[i]:  (P, H', PAGE, ...)   page p holds PAGE consecutive tokens of one row, all its heads
table[b]: [p0, p1, ...]        row b's tokens [k * PAGE, (k + 1) * PAGE) are in page table[b][k]
```
The same rows as packed.py packs (full attention, one token per block, converted or plain full
precision). A row joins by writing its own tokens into free pages and leaves by handing its pages
back: the other rows are never copied, and padding is at most the last page of a row. The pool
grows only when its free pages run out (`reserve`: the engine sizes it for the admitted rows'
final lengths when a row joins, so decode steps never grow it). Every layer of a batch goes
through the same joins, leaves and steps, so their tables are equal and the small index arrays a
step needs are made once for all the layers.

A joining row whose token ids are given shares the pages of a row already here that hold the same
prompt prefix: candidates come from the ids of whole pages (`index`), and a page is shared only if
its bytes equal the joining row's own (so sharing never changes what a row attends over). A row
that writes into a shared page (after a rollback) first gets its own copy of it (copy on write).
A row's pages stay indexed after it leaves: freed pages are taken for new writes last (fresh ones first,
then the longest-freed), so a later row with the same prefix (a second chat turn, a prompt restored
from serve's prefix cache) takes them back instead of writing its own; a page loses its index entries
when it is taken for new bytes. Serve's prefix cache pins the pages of a prompt it keeps (`pin`): a
pinned page is never freed or taken for new bytes while pinned, and a row writing into it copies it
first, as into a page another row shares; `unpin` hands it back (to the free pages, still indexed,
when no row holds it).

Attention reads the pages where they lie (`mx.gather_qmm`, kvcore/attention/paged.py) or gathers
them into a packed view (`PagedView.packed`) for the paths that read contiguous rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .compressed import CompressedKVCache
from .packed import (
    PackedView,
    device_lengths,
    packable,
    row_holding,
    signature,
    trimmed,
)
from .paged_share import PAGE, SharedPages, _as_pages, _pages, _row_parts
from .view import Joint

_SHARED: dict = {}  # key name -> (host key, device array): the last one made, shared by the layers of a step


def _shared(name: str, key, make) -> mx.array:
    slot = _SHARED.get(name)
    if slot is None or slot[0] != key:
        slot = _SHARED[name] = (key, make())
    return slot[1]


def _write_rows(where: tuple, B: int, hp: int, N: int) -> mx.array:
    """Rows of the pool seen as (P * H' * PAGE, W) that token n of row b, head h goes to, in the order
    of the step's (B, H', N, W) update: ((page * H' + h) * PAGE + slot)."""
    pages = mx.array([w[0] for w in where], dtype=mx.int32).reshape(B, 1, N)
    slots = mx.array([w[1] for w in where], dtype=mx.int32).reshape(B, 1, N)
    h = mx.arange(hp, dtype=mx.int32).reshape(1, hp, 1)
    return ((pages * hp + h) * PAGE + slots).reshape(-1)


def _gather(part: mx.array, table: mx.array) -> mx.array:
    """Pages (P, H', PAGE, ...) read through a (B, n) table -> rows (B, H', n * PAGE, ...)."""
    B, n = table.shape
    x = part[table.reshape(-1)].reshape(B, n, *part.shape[1:]).swapaxes(1, 2)
    return x.reshape(B, part.shape[1], n * PAGE, *part.shape[3:])


@dataclass
class PagedView:
    """What a paged layer hands to attention: the pool as it is, each row's pages and length."""

    pool: tuple  # (P, H', PAGE, ...) per part; joint storage: K heads [0, H), V heads [H, 2H)
    table: mx.array  # (B, pages) int32, unused entries 0 (masked by the lengths)
    pages: int  # the table's width: the most pages a row holds
    q_start: mx.array  # (B,) position of each row's first query (its length before this update)
    n_queries: int
    length: int  # the longest row
    key_codec: object
    value_codec: object
    heads: int
    head_dim: int
    value_dim: int
    joint: bool
    n_key_parts: int  # arrays per key (joint: per vector)
    uniform: bool = False
    rotation: object = None
    config: object = None
    stats: object = None
    memo: dict | None = None
    paged = True  # (class attribute) batch attention entry points tell it from a PackedView by this

    @property
    def shape(self):
        return (self.table.shape[0], self.heads, self.length, self.head_dim)

    def packed(self) -> PackedView:
        """The rows gathered into packed buffers (B, H', pages * PAGE, ...): for the paths that read
        contiguous rows."""
        parts = tuple(_gather(p, self.table) for p in self.pool)
        joint = Joint(parts, self.heads) if self.joint else None
        kp, vp = (None, None) if self.joint else (parts[: self.n_key_parts], parts[self.n_key_parts :])
        return PackedView(kp, vp, self.key_codec, self.value_codec, self.q_start, self.n_queries, self.length,
                          self.heads, self.head_dim, self.value_dim, rotation=self.rotation, uniform=self.uniform,
                          config=self.config, stats=self.stats, joint=joint)


class PagedRows(SharedPages):
    def __init__(self, template: CompressedKVCache, pool: tuple, tables: list[list[int]], lengths: list[int],
                 free: list[int]):
        self.template = template.like(template.shape_layout.batch)  # settings only (see PackedRows)
        self.pool = pool
        self.tables = tables
        self.lengths = lengths
        self.free = free  # page ids not in any table, taken from the end (freed pages go to the front)
        self.refs: dict[int, int] = {}  # shared pages: page -> rows whose tables hold it (>= 2)
        self.pins: dict[int, int] = {}  # pages prefix-cache entries hold: page -> how many entries
        self.pinned: dict[int, int] = {}  # pinned page -> the most tokens an entry reads from it
        self.version = 0  # bumped whenever a table changes (the device table is remade only then)
        self._table: tuple | None = None  # (version, device table)
        self.index: dict[int, int] = {}  # hash of the token ids up to a whole page's end -> that page
        self.page_keys: dict[int, set[int]] = {}  # page -> its keys in `index` (dropped when it gets new bytes)

    # -- packing --------------------------------------------------------------
    @staticmethod
    def accepts(rows: list[CompressedKVCache], template: CompressedKVCache | None = None) -> bool:
        if not rows or not all(packable(r) for r in rows):
            return False
        sig = signature(template or rows[0])
        return all(signature(r) == sig for r in rows)

    @classmethod
    def pack(cls, rows: list[CompressedKVCache], ids: list | None = None) -> PagedRows | None:
        """The rows in a new pool; with their token ids (`ids[i]`, or None where unknown), rows share
        the pages of a common prefix (see `join`)."""
        if not cls.accepts(rows):
            return None
        if ids is not None and any(x is not None for x in ids[1:]):
            first = cls.pack(rows[:1], ids[:1])
            first.join(rows[1:], ids[1:])
            return first
        lengths = [r.offset for r in rows]
        counts = [_pages(n + 1) for n in lengths]  # room for the next token
        spare = len(rows)
        tables, first = [], 0
        for c in counts:
            tables.append(list(range(first, first + c)))
            first += c
        parts = []
        for i in range(len(_row_parts(rows[0]))):
            pages = [_as_pages(_row_parts(r)[i], n, c) for r, n, c in zip(rows, lengths, counts)]
            p0 = pages[0]
            pages.append(mx.zeros((spare, *p0.shape[1:]), dtype=p0.dtype))
            parts.append(mx.concatenate(pages, axis=0))
        free = list(range(first + spare - 1, first - 1, -1))
        out = cls(rows[0], tuple(parts), tables, lengths, free)
        for table, x in zip(tables, ids or []):
            out._remember(table, x)
        return out

    def join(self, rows: list[CompressedKVCache], ids: list | None = None) -> None:
        """Add rows (packable, with this layer's settings): their own tokens into free pages, or, for
        a row whose token ids are given, the pages of a row here that hold the same bytes for the
        same prefix (shared)."""
        ids = list(ids) if ids is not None else [None] * len(rows)
        lengths = [r.offset for r in rows]
        counts = [_pages(n + 1) for n in lengths]
        shared = [self._shareable(r, n, x) for r, n, x in zip(rows, lengths, ids)]
        free = set(self.free) if any(shared) else ()
        revived = {p for sh in shared for p in sh if p in free}  # a departed row's pages, indexed still
        if revived:
            self.free = [p for p in self.free if p not in revived]
        self.reserve(sum(c - len(sh) for c, sh in zip(counts, shared)))
        held = self.held() if any(shared) else set()
        tables, writes = [], []
        for r, n, c, sh in zip(rows, lengths, counts, shared):
            own = self._take(c - len(sh))
            for p in sh:
                if p in held:
                    self.refs[p] = self.refs.get(p, 1) + 1
                else:  # its first holder again (a departed row's page, or one only a prefix entry pins)
                    held.add(p)
            tables.append(sh + own)
            if own:
                writes.append((r, n, c, len(sh), own))
        if writes:
            flat = mx.array([p for *_, own in writes for p in own], dtype=mx.int32)
            pool = list(self.pool)
            for i in range(len(pool)):
                pool[i][flat] = mx.concatenate([_as_pages(_row_parts(r)[i], n, c)[k:] for r, n, c, k, _ in writes],
                                               axis=0)
            self.pool = tuple(pool)
        for table, x in zip(tables, ids):
            self._remember(table, x)
        self.tables += tables
        self.lengths += lengths
        self.version += 1

    def reserve(self, pages: int, exact: bool = False) -> None:
        """At least `pages` free pages (unless `exact`, the pool grows by a quarter at least, so
        growing as rows decode is rare)."""
        short = pages - len(self.free)
        if short <= 0:
            return
        total = self.pool[0].shape[0]
        grow = short if exact else max(short, total // 4)
        self.pool = tuple(mx.concatenate([p, mx.zeros((grow, *p.shape[1:]), dtype=p.dtype)], axis=0) for p in self.pool)
        self.free += list(range(total + grow - 1, total - 1, -1))  # fresh pages before the freed ones

    def reserve_tokens(self, finals: list[int]) -> None:
        """Room for every row to reach its final length (in the rows' order): the engine asks when a
        row joins, so that decode steps never grow the pool."""
        need = sum(max(0, _pages(f + 1) - len(t)) for f, t in zip(finals, self.tables))
        self.reserve(need, exact=True)

    def unpack(self) -> list[CompressedKVCache]:
        return [self.gather_row(table, n) for table, n in zip(self.tables, self.lengths)]

    # -- decode -------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> PagedView:
        """keys: (B, H, N, D), each row's next N tokens, written at its own length."""
        B, H, N, D = keys.shape
        t = self.template
        new = (keys, values) if t.key_codec is None else t.encode_tokens(keys, values)
        if self.refs or self.pins:  # pages about to be written that other rows share or entries pin: copies first
            for b, n in enumerate(self.lengths):
                for k in range(n // PAGE, min(_pages(n + N), len(self.tables[b]))):
                    self._own_page(b, k, max(n - k * PAGE, 0))
        grow = sum(max(0, _pages(n + N) - len(tb)) for n, tb in zip(self.lengths, self.tables))
        if grow:
            self.reserve(grow)
            for n, tb in zip(self.lengths, self.tables):
                tb.extend(self._take(max(0, _pages(n + N) - len(tb))))
            self.version += 1
        q_start = device_lengths(self.lengths)
        where = tuple((tb[(n + j) // PAGE], (n + j) % PAGE) for tb, n in zip(self.tables, self.lengths) for j in range(N))
        hp = self.pool[0].shape[1]
        rows = _shared("write", (where, hp, N), lambda: _write_rows(where, B, hp, N))  # (B * H' * N,)
        out = []
        for p, v in zip(self.pool, new):  # the pool as rows of one token and head: one scatter of the step's rows
            w = p.shape[-1]
            idx = _shared(("write", w), (where, hp, N, w), lambda w=w: mx.broadcast_to(rows[:, None], (rows.shape[0], w)))
            flat = mx.put_along_axis(p.reshape(-1, w), idx, v.reshape(-1, w), axis=0)
            out.append(flat.reshape(p.shape))
        self.pool = tuple(out)
        self.lengths = [n + N for n in self.lengths]
        width = max(len(tb) for tb in self.tables)
        if self._table is None or self._table[0] != self.version:  # every layer's tables are equal: one array
            key = tuple(tuple(tb) for tb in self.tables)
            self._table = (self.version, _shared("table", key, lambda: mx.array(
                [tb + [0] * (width - len(tb)) for tb in self.tables], dtype=mx.int32)))
        table = self._table[1]
        lay = t.shape_layout
        return PagedView(self.pool, table, width, q_start, N, max(self.lengths), t.key_codec, t.value_codec, H, D,
                         values.shape[-1], t.joint, (lay.key_parts or 1) if t.key_codec is not None else 1,
                         uniform=len(set(self.lengths)) == 1, config=t.attention, stats=t.stats, memo=t.memo)

    # -- batch protocol -----------------------------------------------------
    def filter(self, idx: list[int]) -> None:
        keep = set(idx)
        freed = []
        for b, tb in enumerate(self.tables):
            if b in keep:
                continue
            for p in reversed(tb):
                if p in self.refs:  # still another row's
                    self.refs[p] -= 1
                    if self.refs[p] < 2:
                        del self.refs[p]
                elif p not in self.pins:  # a pinned page stays out of the free pages
                    freed.append(p)
        self.free[:0] = freed  # taken last: a later row with the same prefix can take them back (join)
        self.tables = [self.tables[i] for i in idx]
        self.lengths = [self.lengths[i] for i in idx]
        self.version += 1

    def gather_row(self, pages: list[int], n: int) -> CompressedKVCache:
        """A one-row cache (this layer's settings) holding a copy of the n tokens in `pages`."""
        idx = mx.array([pages], dtype=mx.int32)
        return row_holding(self.template, n, tuple(mx.contiguous(_gather(p, idx)[:, :, :n]) for p in self.pool))

    def trim_rows(self, ns: list[int]) -> list[int]:
        self.lengths, done = trimmed(self.lengths, ns)
        return done

    @property
    def pages_used(self) -> int:
        """Distinct pages the rows hold (a shared page once)."""
        return len({p for tb in self.tables for p in tb})

    @property
    def page_bytes(self) -> int:
        return sum(p.nbytes // p.shape[0] for p in self.pool)

    @property
    def nbytes(self) -> int:
        """Bytes of the rows' stored tokens (the pool holds `allocated`)."""
        return sum(n * self.page_bytes // PAGE for n in self.lengths)

    @property
    def allocated(self) -> int:
        return sum(p.nbytes for p in self.pool)

    @property
    def elements(self) -> int:
        lay = self.template.shape_layout
        return sum(self.lengths) * lay.heads * (lay.head_dim + lay.value_dim)

    @property
    def state(self) -> tuple:
        return self.pool
