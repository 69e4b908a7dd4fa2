"""The sharing half of PagedRows (paged.py): a prefix index over whole pages, so a joining row takes
the pages of a prompt prefix another row (or a departed one) wrote, copy on write for pages that
rows share or prefix-cache entries pin, and the pins themselves (serve's prefix cache, serve/prefix.py).
The state lives on PagedRows: `tables`, `free`, `refs`, `pins`, `pinned`, `index`, `page_keys`, `pool`."""

from __future__ import annotations

import mlx.core as mx

from .compressed import CompressedKVCache

PAGE = 128  # tokens per page
_KEYS: dict = {}  # the last joining row's ids and their page keys (every layer asks for the same)


def _pages(n: int) -> int:
    return -(-n // PAGE)


def _as_pages(part: mx.array, n: int, pages: int) -> mx.array:
    """One row's (1, H', n, ...) tokens -> (pages, H', PAGE, ...)."""
    pad = pages * PAGE - n
    p = mx.pad(part, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (part.ndim - 3)) if pad else part
    p = p.reshape(p.shape[1], pages, PAGE, *p.shape[3:])
    return p.swapaxes(0, 1)


def _row_parts(row: CompressedKVCache) -> tuple:
    return (row.enc if row.key_codec is not None else row.tail).get()


class SharedPages:
    """PagedRows' prefix index, copy on write and pins (a mixin: the state is PagedRows')."""

    # -- shared prefixes --------------------------------------------------------
    @staticmethod
    def _keys(x, pages: int) -> list[int]:
        """A key per whole page naming the ids up to its end: each page's key hashes the one before
        it with its own ids (linear in the prompt), made once for all the layers of a join."""
        last = _KEYS.get("last")
        if last is not None and last[0] is x and len(last[1]) >= pages:
            return last[1][:pages]
        keys, key = [], 0
        for k in range(len(x) // PAGE):
            key = hash((key, tuple(x[k * PAGE : (k + 1) * PAGE])))
            keys.append(key)
        _KEYS["last"] = (x, keys)
        return keys[:pages]

    def _remember(self, table: list[int], x) -> None:
        """Index the whole pages of a row whose token ids are `x` (None: not indexed)."""
        if x is None:
            return
        for key, page in zip(self._keys(x, len(x) // PAGE), table):
            if self.index.setdefault(key, page) == page:
                self.page_keys.setdefault(page, set()).add(key)

    def _take(self, n: int) -> list[int]:
        """n free pages for new bytes (the caller reserved them): their index entries go."""
        pages = [self.free.pop() for _ in range(n)]
        for p in pages:
            for key in self.page_keys.pop(p, ()):
                if self.index.get(key) == p:
                    del self.index[key]
        return pages

    def _shareable(self, row: CompressedKVCache, n: int, x) -> list[int]:
        """Pages here holding the bytes of `row`'s first whole pages (its ids `x` name candidates)."""
        if x is None or len(x) != n or n < PAGE:
            return []
        cands = []
        for key in self._keys(x, n // PAGE):
            page = self.index.get(key)
            if page is None or page in cands:
                break
            cands.append(page)
        if not cands:
            return []
        idx = mx.array(cands, dtype=mx.int32)
        same = None
        for p, mine in zip(self.pool, _row_parts(row)):
            own = _as_pages(mine[:, :, : len(cands) * PAGE], len(cands) * PAGE, len(cands))
            eq = mx.all((p[idx] == own).reshape(len(cands), -1), axis=1)
            same = eq if same is None else same & eq
        ok = same.tolist()  # one read back per joining row and layer
        k = next((i for i, v in enumerate(ok) if not v), len(ok))
        return cands[:k]

    def _own_page(self, b: int, k: int, slot: int) -> None:
        """Copy on write: row b, about to write its k-th page from `slot` on, gets its own copy of it if
        other rows share it or a prefix entry reads that slot (a prompt's part-filled last page is
        written past the entry's tokens in place)."""
        page = self.tables[b][k]
        if page not in self.refs and self.pinned.get(page, 0) <= slot:
            return
        self.reserve(1)
        new = self._take(1)[0]
        pool = list(self.pool)
        for i in range(len(pool)):
            pool[i][new] = pool[i][page]
        self.pool = tuple(pool)
        self.tables[b][k] = new
        self.version += 1
        if page in self.refs:
            self.refs[page] -= 1
            if self.refs[page] < 2:
                del self.refs[page]

    # -- prefix-cache entries -------------------------------------------------------
    def held(self) -> set[int]:
        """Pages some row's table holds."""
        return {p for tb in self.tables for p in tb}

    def row_pages(self, b: int) -> tuple[list[int], int]:
        """Row b's pages and length (what a prefix entry pins)."""
        n = self.lengths[b]
        return self.tables[b][: _pages(n)], n

    def pin(self, pages: list[int], n: int) -> None:
        """An entry holds the first n tokens of `pages`."""
        for k, p in enumerate(pages):
            self.pins[p] = self.pins.get(p, 0) + 1
            self.pinned[p] = max(self.pinned.get(p, 0), min(PAGE, n - k * PAGE))

    def unpin(self, pages: list[int]) -> None:
        """An entry lets its pages go: those no row holds (nor another entry) join the free pages, taken
        last and still indexed, so a later row with the same prefix may take them back."""
        held, freed = self.held(), []
        for p in pages:
            self.pins[p] -= 1
            if self.pins[p] == 0:
                del self.pins[p], self.pinned[p]
                if p not in held:
                    freed.append(p)
        self.free[:0] = freed

    def compact(self, min_free: int) -> dict[int, int] | None:
        """An idle pool (no row) whose free pages outnumber the pinned ones (and `min_free`) keeps only the
        pinned pages, renumbered in their order: the memory a burst of rows grew it by goes back. Returns the
        renumbering (old page -> new) for the entries, or None where it keeps everything."""
        if self.tables or len(self.free) <= max(len(self.pins), min_free):
            return None
        keep = sorted(self.pins)
        new = {p: i for i, p in enumerate(keep)}
        idx = mx.array(keep, dtype=mx.int32)
        self.pool = tuple(part[idx] if keep else part[:0] for part in self.pool)
        mx.eval(self.pool)
        self.free, self.refs = [], {}
        self.pins = {new[p]: c for p, c in self.pins.items()}
        self.pinned = {new[p]: n for p, n in self.pinned.items()}
        self.index = {k: new[p] for k, p in self.index.items() if p in new}
        self.page_keys = {new[p]: ks for p, ks in self.page_keys.items() if p in new}
        self.version += 1
        return new
