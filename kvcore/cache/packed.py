"""PackedRows: the rows of a batch cache in shared, right-padded buffers, for fast decode.

When every row of a layer is a full-attention cache that stores each token on its own
(already-converted per-token codec, or plain full precision), the rows are packed:

```
parts[i]: (B, H, capacity, ...)   row b holds its tokens at [0, lengths[b]); the rest is spare
```
One quantize, one scatter per part, one decode and one attention call per layer then serve
every row, whatever B is. Anything else (windows, token-grouped codecs, rows not yet
converted, left-padded prefill) keeps the row-by-row storage; `unpack` gives rows back.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .compressed import CompressedKVCache
from .view import Joint

STEP = 256
_LAST: dict = {}  # the last row lengths handed to the device, and their array
_STEP: dict = {}  # per_step: name -> (q_start, n, value)


def device_lengths(lengths: list[int]) -> mx.array:
    """`lengths` as a device array, made once for all the layers of a step: every layer of a
    batch holds the same lengths, and an array made on the host costs a transfer (on CUDA a
    managed-memory page) each time it is made."""
    key = tuple(lengths)
    if _LAST.get("key") != key:
        _LAST["key"], _LAST["array"] = key, mx.array(key, dtype=mx.int32)
    return _LAST["array"]


def per_step(name: str, q_start: mx.array, n: int, make):
    """`make()` once per decode step for all its layers: every layer of a batch shares the step's
    q_start array (`device_lengths`), and each op is a node MLX encodes on the host, per layer otherwise.
    The array is held, so its identity names the step."""
    slot = _STEP.get(name)
    if slot is None or slot[0] is not q_start or slot[1] != n:
        slot = _STEP[name] = (q_start, n, make())
    return slot[2]


def write_index(q_start: mx.array, N: int) -> mx.array:
    """(B, 1, N) columns the step's N tokens go to."""
    return per_step("index", q_start, N, lambda: (q_start[:, None] + mx.arange(N)[None]).reshape(-1, 1, N))


def part_index(q_start: mx.array, N: int, shape: tuple) -> mx.array:
    """The write index broadcast to one part's update shape (B, H, N, ...): made once per step for all
    the layers (each reshape and broadcast is a node the host encodes, per part and layer otherwise)."""
    def make():
        idx = write_index(q_start, N)
        return mx.broadcast_to(idx.reshape(shape[0], 1, N, *([1] * (len(shape) - 3))), shape)

    return per_step(("index", shape), q_start, N, make)


def trimmed(lengths: list[int], ns: list[int]) -> tuple[list[int], list[int]]:
    """(lengths after trimming up to ns[b] tokens off row b, the tokens each row really lost)."""
    done = [min(int(n), length) for n, length in zip(ns, lengths)]
    return [length - n for length, n in zip(lengths, done)], done


def packable(row: CompressedKVCache) -> bool:
    if row.window is not None or row.shape_layout is None or row.sink.n or row.enc_start != 0:
        return False
    if row.key_codec is None and row.value_codec is None:
        return row.enc.n == 0 and row.tail_start == 0  # plain full precision, all in the tail
    return (row.key_codec is not None and row.value_codec is not None and row.converted
            and row.block_tokens == 1 and row.tail.n == 0)


def row_holding(template: CompressedKVCache, n: int, own: tuple) -> CompressedKVCache:
    """A one-row cache with `template`'s settings holding `own`, its n tokens as a batch stored them
    (encoded parts, or dense k, v for a full-precision layer)."""
    row = template.like(1)
    row.offset = n
    if template.key_codec is not None:
        row.enc.set(own)
        row.enc_start, row.tail_start = 0, n
    else:
        row.tail.set(own)
        row.enc_start = row.tail_start = 0
    return row


def signature(row: CompressedKVCache):
    return (row.key_spec, row.value_spec, row.shape_layout)


@dataclass
class PackedView:
    """What a packed layer hands to attention: decoded on demand, masked by row lengths."""

    _key_parts: tuple | None  # None with `joint`: its K and V halves, made when first asked for
    _value_parts: tuple | None
    key_codec: object
    value_codec: object
    q_start: mx.array  # (B,) position of each row's first query
    n_queries: int
    length: int  # columns: the longest row
    heads: int
    head_dim: int
    value_dim: int
    rotation: object = None  # set: dense() returns R k, R v (attention in a rotation codec's basis)
    uniform: bool = False  # every row holds the same number of tokens: no mask needed
    config: object = None  # the rows' AttentionConfig
    stats: object = None  # the cache set's AttentionStats
    joint: Joint | None = None  # K and V in one set of arrays (key_parts, value_parts: views of it)
    memo: dict | None = None  # the rows' shared settings' own (KVView.memo): attention's derivations, kept

    @property
    def key_parts(self) -> tuple:
        if self._key_parts is None:  # joint storage: the halves are views, built only if a path reads them
            self._key_parts, self._value_parts = self.joint.halves(self.joint.capacity)
        return self._key_parts

    @property
    def value_parts(self) -> tuple:
        self.key_parts  # noqa: B018 - makes both halves
        return self._value_parts

    @property
    def capacity(self) -> int:
        return self.joint.capacity if self.joint is not None else self._key_parts[0].shape[2]

    @property
    def shape(self):
        arrays = self.joint.arrays if self.joint is not None else self._key_parts
        return (arrays[0].shape[0], self.heads, self.length, self.head_dim)

    def dense(self, lo: int, hi: int, dtype) -> tuple[mx.array, mx.array]:
        if self.joint is not None and self.rotation is None:  # one decode call reads K and V
            x = self.key_codec.decode(tuple(p[:, :, lo:hi] for p in self.joint.arrays), dtype)
            return x[:, : self.heads], x[:, self.heads :]

        def dec(codec, parts):
            sl = tuple(p[:, :, lo:hi] for p in parts)
            if self.rotation is not None:
                return (self.rotation.forward(sl[0]) if codec is None else codec.decode_rotated(sl, dtype)).astype(dtype)
            return sl[0] if codec is None else codec.decode(sl, dtype)

        return dec(self.key_codec, self.key_parts), dec(self.value_codec, self.value_parts)

    def visible(self, lo: int, hi: int) -> mx.array:
        """(B, 1, N, hi-lo): causal per row; columns past a row's tokens are never visible."""
        q = self.q_start[:, None] + mx.arange(self.n_queries)[None]  # (B, N)
        j = mx.arange(lo, hi)
        return (j[None, None, :] <= q[:, :, None])[:, None]


class PackedRows:
    def __init__(self, template: CompressedKVCache, parts: tuple, lengths: list[int]):
        # a row's settings (specs, codecs, dims) that every row shares, without its buffers
        # (holding them would keep that row's own copy of its tokens alive beside the packed one)
        self.template = template.like(template.shape_layout.batch)
        self.parts = parts
        self.lengths = lengths

    # -- packing ------------------------------------------------------------
    @classmethod
    def pack(cls, rows: list[CompressedKVCache]) -> "PackedRows | None":
        if not rows or not all(packable(r) for r in rows) or len({signature(r) for r in rows}) > 1:
            return None
        buffers = [(r.enc if r.key_codec is not None else r.tail) for r in rows]
        lengths = [r.offset for r in rows]
        cap = (max(lengths) + STEP) // STEP * STEP
        parts = []
        for i in range(len(buffers[0].get())):
            cols = []
            for buf, n in zip(buffers, lengths):
                p = buf.get()[i]
                cols.append(mx.pad(p, [(0, 0), (0, 0), (0, cap - n)] + [(0, 0)] * (p.ndim - 3)))
            parts.append(mx.concatenate(cols, axis=0))
        return cls(rows[0], tuple(parts), lengths)

    def unpack(self) -> list[CompressedKVCache]:
        return [row_holding(self.template, n, tuple(mx.contiguous(p[b : b + 1, :, :n]) for p in self.parts))
                for b, n in enumerate(self.lengths)]

    # -- decode -------------------------------------------------------------
    def make_room(self, n: int) -> bool:
        """Grow the parts (by whole steps) now if every row's next `n` tokens would not fit; whether they grew."""
        need = max(self.lengths) + n
        if need <= self.parts[0].shape[2]:
            return False
        grow = (need - self.parts[0].shape[2] + STEP - 1) // STEP * STEP
        self.parts = tuple(mx.pad(p, [(0, 0), (0, 0), (0, grow)] + [(0, 0)] * (p.ndim - 3)) for p in self.parts)
        return True

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> PackedView:
        """keys: (B, H, N, D), each row's next N tokens, written at its own length."""
        _, H, N, D = keys.shape
        t = self.template
        new = (keys, values) if t.key_codec is None else t.encode_tokens(keys, values)
        self.make_room(N)  # where no one made room before the step
        q_start = device_lengths(self.lengths)
        self.parts = tuple(mx.put_along_axis(p, part_index(q_start, N, tuple(v.shape)), v, axis=2)
                           for p, v in zip(self.parts, new))
        self.lengths = [n + N for n in self.lengths]
        L = max(self.lengths)
        joint = Joint(self.parts, H) if t.joint else None
        if joint is not None:
            kp = vp = None  # PackedView makes the halves if a path asks for them (the kernel reads `joint`)
        else:
            nk = t.shape_layout.key_parts or 1 if t.key_codec is not None else 1
            kp, vp = self.parts[:nk], self.parts[nk:]
        return PackedView(kp, vp, t.key_codec, t.value_codec, q_start, N, L, H, D, values.shape[-1],
                          uniform=len(set(self.lengths)) == 1, config=t.attention, stats=t.stats, joint=joint,
                          memo=t.memo)

    # -- batch protocol -----------------------------------------------------
    def filter(self, idx: list[int]) -> None:
        sel = mx.array(idx)
        self.parts = tuple(p[sel] for p in self.parts)
        self.lengths = [self.lengths[i] for i in idx]

    def trim_rows(self, ns: list[int]) -> list[int]:
        self.lengths, done = trimmed(self.lengths, ns)
        return done

    @property
    def nbytes(self) -> int:
        cap = self.parts[0].shape[2]
        return sum(p.nbytes // p.shape[0] // cap * n for p in self.parts for n in self.lengths)

    @property
    def elements(self) -> int:
        lay = self.template.shape_layout
        H, D, Dv = lay.heads, lay.head_dim, lay.value_dim
        return sum(self.lengths) * H * (D + Dv)

    @property
    def state(self) -> tuple:
        return self.parts
