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
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from .compressed import CompressedKVCache
from .view import BatchKVView


class BatchCompressedKVCache(_BaseCache):
    def __init__(self, rows: list[CompressedKVCache]):
        self.rows = list(rows)
        self._pad = [0] * len(self.rows)  # padding columns still to come, per row

    # -- protocol -----------------------------------------------------------
    @property
    def offset(self) -> mx.array:
        return mx.array([r.offset - p for r, p in zip(self.rows, self._pad)])

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None, **kwargs):
        if right_padding is not None and max(right_padding) > 0:
            raise ValueError("right padding is not supported; pad prompts on the left")
        if left_padding is not None:
            self._pad = [p + int(x) for p, x in zip(self._pad, left_padding)]

    def finalize(self):
        self._pad = [0] * len(self.rows)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        N = keys.shape[2]
        views, skips = [], []
        for b, row in enumerate(self.rows):
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
        return min(self.trim_rows([n] * len(self.rows)), default=0)

    def trim_rows(self, ns: list[int]) -> list[int]:
        """Roll each row back by its own count; returns what each row could trim."""
        return [r.trim(int(n)) if n else 0 for r, n in zip(self.rows, ns)]

    def size(self) -> int:
        return max((r.size() for r in self.rows), default=0)

    def empty(self) -> bool:
        return all(r.empty() for r in self.rows)

    @property
    def state(self) -> tuple:
        return tuple(a for r in self.rows for a in r.state)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rows)

    @property
    def elements(self) -> int:
        return sum(r.elements for r in self.rows)

    @property
    def converted(self) -> bool:
        return any(r.converted for r in self.rows)

    # -- batch protocol -----------------------------------------------------
    def filter(self, batch_indices) -> None:
        idx = batch_indices.tolist() if isinstance(batch_indices, mx.array) else list(batch_indices)
        self.rows = [self.rows[i] for i in idx]
        self._pad = [self._pad[i] for i in idx]

    def extend(self, other: "BatchCompressedKVCache") -> None:
        self.rows += other.rows
        self._pad += other._pad

    def extract(self, idx: int) -> CompressedKVCache:
        return self.rows[idx]

    @classmethod
    def merge(cls, caches: list) -> "BatchCompressedKVCache":
        rows = []
        for c in caches:
            rows.extend(c.rows if isinstance(c, cls) else [c])
        return cls(rows)
