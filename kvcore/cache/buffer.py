"""A tuple of arrays that grows along axis 2 with spare capacity (as mlx-lm's KVCache does)."""

from __future__ import annotations

import mlx.core as mx

STEP = 256


class Buffer:
    """Parts share axis 2 (tokens or blocks); `n` entries of it are in use.

    ```
    parts[i]: (B, H, capacity, ...)   [0, n) in use, [n, capacity) spare
    ```
    """

    def __init__(self, step: int = STEP):
        self.parts: tuple[mx.array, ...] | None = None
        self.n = 0
        self.step = step
        self.hint = 0  # entries `reserve` asked for before the parts' shapes were known

    def __len__(self) -> int:
        return self.n

    @property
    def capacity(self) -> int:
        return 0 if self.parts is None else self.parts[0].shape[2]

    def append(self, new: tuple[mx.array, ...]) -> None:
        k = new[0].shape[2]
        if k == 0:
            return
        n = self.n
        if self.parts is None or n + k > self.parts[0].shape[2]:
            self._room(k, [p.shape for p in new], [p.dtype for p in new])
        cols = slice(n, n + k)
        for part, value in zip(self.parts, new):
            part[:, :, cols] = value
        self.n = n + k

    def append_halves(self, first: tuple[mx.array, ...], second: tuple[mx.array, ...]) -> None:
        """Append parts whose axis 1 is `first`'s then `second`'s (joint K/V storage), written
        straight into the two halves: no concatenated copy of the new entries."""
        k = first[0].shape[2]
        if k == 0:
            return
        shapes = [(a.shape[0], a.shape[1] + b.shape[1], *a.shape[2:]) for a, b in zip(first, second)]
        self._room(k, shapes, [a.dtype for a in first])
        for part, a, b in zip(self.parts, first, second):
            h = a.shape[1]
            part[:, :h, self.n : self.n + k] = a
            part[:, h:, self.n : self.n + k] = b
        self.n += k

    def _room(self, k: int, shapes: list, dtypes: list) -> None:
        """Capacity for k more entries of parts shaped like `shapes` (axis 2 aside)."""
        if self.parts is not None and self.n + k <= self.capacity:
            return
        grow = max((k + self.step - 1) // self.step * self.step, -(-self.hint // self.step) * self.step - self.n)
        self.hint = 0

        def widen(old, shape, dtype):
            spare = mx.zeros((*shape[:2], grow, *shape[3:]), dtype=dtype)
            return spare if old is None else mx.concatenate([old[:, :, : self.n], spare], axis=2)

        olds = self.parts or (None,) * len(shapes)
        self.parts = tuple(widen(o, sh, dt) for o, sh, dt in zip(olds, shapes, dtypes))

    def make_room(self, k: int) -> bool:
        """Grow now (by whole steps, as `append` would) if k more entries would not fit; whether it grew."""
        if self.parts is None or self.n + k <= self.capacity:
            return False
        self._room(k, [p.shape for p in self.parts], [p.dtype for p in self.parts])
        return True

    def reserve(self, n: int) -> None:
        """Room for n entries in all (rounded up to whole steps), allocated once: a prefill that knows its length
        grows the buffer once instead of copying it at every chunk (each copy holds old and new at once), and the
        decode steps after it find room for up to a step's tokens more (an exact fit made the first one copy the
        whole buffer again)."""
        if self.parts is None:
            self.hint = max(self.hint, n)
            return
        if n <= self.capacity:
            return
        spare = -(-n // self.step) * self.step - self.n
        self.parts = tuple(mx.concatenate([p[:, :, : self.n], mx.zeros((*p.shape[:2], spare, *p.shape[3:]), dtype=p.dtype)],
                                          axis=2) for p in self.parts)

    def get(self, start: int = 0, stop: int | None = None) -> tuple[mx.array, ...]:
        stop = self.n if stop is None else stop
        return tuple(p[:, :, start:stop] for p in self.parts)

    def drop_front(self, k: int) -> None:
        if k <= 0:
            return
        if k >= self.n:
            self.clear()
            return
        self.parts = tuple(p[:, :, k : self.n] for p in self.parts)
        self.n -= k

    def truncate(self, n: int) -> None:
        self.n = max(0, min(n, self.n))

    def clear(self) -> None:
        self.parts, self.n, self.hint = None, 0, 0

    def set(self, parts: tuple[mx.array, ...]) -> None:
        self.parts, self.n = parts, parts[0].shape[2]

    @property
    def nbytes(self) -> int:
        if self.parts is None or self.n == 0:
            return 0
        return sum(p.nbytes * self.n // p.shape[2] for p in self.parts)
