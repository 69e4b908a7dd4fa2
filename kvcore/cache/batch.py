"""BatchCompressedKVCache: many rows of CompressedKVCache decoding in one forward pass.

Each row keeps its own storage, so everything stays row-local: its conversion start, its
window, its trim (rollback), its token blocks (padding never enters a codec because it is
never stored). Left-padded prefill is accepted as in mlx-lm's BatchKVCache:

```
prompts [1 3 5], [7], [2 6 8 9]  ->  columns  [0 1 3 5]   left_padding = [1, 3, 0]
                                              [0 0 0 7]
                                              [2 6 8 9]
```
The padding columns of an update are dropped per row before storing; `offset` is the
per-row RoPE position of the update's first column (negative inside padding), as mlx-lm
models expect from a batch cache.

When every row is a plain full-attention, per-token layer (see `packed.py`), the rows share
storage so one set of ops serves the whole batch: pages of one pool (`paged.py`: a row joins or
leaves without the others being copied) or, where the attention config says so (CUDA, whose
kernel reads packed rows), packed buffers; `rows` unpacks.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from .compressed import CompressedKVCache
from .packed import PackedRows, device_lengths
from .paged import PagedRows
from .view import BatchKVView


class BatchCompressedKVCache(_BaseCache):
    def __init__(self, rows: list[CompressedKVCache]):
        self._rows = list(rows)
        self.packed: PackedRows | PagedRows | None = None
        self._pad = [0] * len(self._rows)  # padding columns still to come, per row

    # -- storage modes --------------------------------------------------------
    @property
    def rows(self) -> list[CompressedKVCache]:
        """The row caches (unpacking the shared buffers if they are packed)."""
        if self.packed is not None:
            self._rows, self.packed = self.packed.unpack(), None
        return self._rows

    @property
    def live_rows(self) -> list[CompressedKVCache]:
        """Rows that may still change storage form (conversion); packed rows never do."""
        return [] if self.packed is not None else self._rows

    def _maybe_pack(self, ids: list | None = None, single: bool = False) -> None:
        """Pack the rows if they all pack; `ids`: their token ids (None where unknown), for paged
        rows to share the pages of a common prefix. `single`: a lone row goes into pages too (serve's
        prefix cache keeps pages of the pool, which must exist from the first row)."""
        if self.packed is None and not any(self._pad) and (len(self._rows) > 1 or single and self._rows):
            if self._rows[0].attention.pages:
                self.packed = PagedRows.pack(self._rows, ids)
            elif len(self._rows) > 1:
                self.packed = PackedRows.pack(self._rows)
            if self.packed is not None:
                self._rows = []

    @property
    def paged(self) -> PagedRows | None:
        return self.packed if isinstance(self.packed, PagedRows) else None

    @property
    def batch_size(self) -> int:
        return len(self.packed.lengths) if self.packed is not None else len(self._rows)

    # -- protocol -----------------------------------------------------------
    @property
    def offset(self) -> mx.array:
        if self.packed is not None:
            return device_lengths(self.packed.lengths)
        return mx.array([r.offset - p for r, p in zip(self._rows, self._pad)])

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None, **kwargs):
        if right_padding is not None and max(right_padding) > 0:
            raise ValueError("right padding is not supported; pad prompts on the left")
        if left_padding is not None:
            rows = self.rows
            self._pad = [p + int(x) for p, x in zip(self._pad or [0] * len(rows), left_padding)]

    def finalize(self):
        self._pad = [0] * self.batch_size

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self._maybe_pack()
        if self.packed is not None:
            view = self.packed.update_and_fetch(keys, values)
            return view, view
        N = keys.shape[2]
        views, skips = [], []
        for b, row in enumerate(self._rows):
            skip = min(N, self._pad[b])
            self._pad[b] -= skip
            skips.append(skip)
            if skip == N:
                views.append(None)  # all padding in this update
                continue
            v, _ = row.update_and_fetch(keys[b : b + 1, :, skip:], values[b : b + 1, :, skip:])
            views.append(v)
        view = BatchKVView(views, skips, N)
        return view, view

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return None if N == 1 else "causal"

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        return min(self.trim_rows([n] * self.batch_size), default=0)

    def trim_rows(self, ns: list[int]) -> list[int]:
        """Roll each row back by its own count; returns what each row could trim."""
        if self.packed is not None:
            return self.packed.trim_rows(ns)
        return [r.trim(int(n)) if n else 0 for r, n in zip(self._rows, ns)]

    def size(self) -> int:
        if self.packed is not None:
            return max(self.packed.lengths, default=0)
        return max((r.size() for r in self._rows), default=0)

    def empty(self) -> bool:
        return self.packed is None and all(r.empty() for r in self._rows)

    @property
    def state(self) -> tuple:
        if self.packed is not None:
            return self.packed.state
        return tuple(a for r in self._rows for a in r.state)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes if self.packed is not None else sum(r.nbytes for r in self._rows)

    @property
    def elements(self) -> int:
        return self.packed.elements if self.packed is not None else sum(r.elements for r in self._rows)

    @property
    def converted(self) -> bool:
        if self.packed is not None:
            return self.packed.template.converted
        return any(r.converted for r in self._rows)

    # -- batch protocol -----------------------------------------------------
    def filter(self, batch_indices) -> None:
        idx = batch_indices.tolist() if isinstance(batch_indices, mx.array) else list(batch_indices)
        if self.packed is not None:
            self.packed.filter(idx)
        else:
            self._rows = [self._rows[i] for i in idx]
        self._pad = [self._pad[i] for i in idx] if self._pad else []

    def extend(self, other: "BatchCompressedKVCache", ids: list | None = None) -> None:
        """Add `other`'s rows; `ids`: their token ids (None where unknown), so paged rows may share
        the pages of a prefix rows here hold."""
        pad = (self._pad or [0] * self.batch_size) + (other._pad or [0] * other.batch_size)
        new = other.rows
        if isinstance(self.packed, PagedRows) and not any(pad) and PagedRows.accepts(new, self.packed.template):
            self.packed.join(new, ids)  # into free pages: the rows already here are not copied
        else:
            self._rows = self.rows + new  # repacked at the next update
        self._pad = pad

    def make_room(self, n: int) -> bool:
        """Packed rows grow their parts now if the next `n` tokens would not fit (paged rows reserve at a join)."""
        return isinstance(self.packed, PackedRows) and self.packed.make_room(n)

    def reserve_tokens(self, finals: list[int]) -> None:
        """Room for the rows (in their order) to reach these lengths without growing storage later
        (paged rows; the others grow as they go)."""
        if isinstance(self.packed, PagedRows):
            self.packed.reserve_tokens(finals)

    def extract(self, idx: int) -> CompressedKVCache:
        return self.rows[idx]

    @classmethod
    def merge(cls, caches: list) -> "BatchCompressedKVCache":
        rows = []
        for c in caches:
            rows.extend(c.rows if isinstance(c, cls) else [c])
        return cls(rows)
