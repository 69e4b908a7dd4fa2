"""Pack b-bit indices (1 <= b <= 8) densely into bytes, in pure MLX.

Along the last axis, every 8 / gcd(b, 8) values fill b / gcd(b, 8) bytes exactly: value i
occupies the bit range [i*b, i*b + b) of the group's little-endian bit stream, split over two
bytes where it crosses a byte boundary. Packing and unpacking are shifts and masks:
```
value i, byte j: offset o = i*b - 8*j   (bits of value i start at bit o of byte j)
pack:   byte_j  = sum_i ((v_i >> max(-o, 0)) << max(o, 0))   over the values that touch byte j
unpack: v_i     = sum_j (((byte_j >> max(o, 0)) << max(-o, 0)) & (2**b - 1))
```
For n a multiple of 8 (b < 8), `pack` builds the same bytes from one little-endian word per 8
values (`sum_i v_i << i*b`, then its b bytes): a few compiled nodes, no (values x bytes) temporary.
`lookup` unpacks and maps indices to values in one step: a table indexed by a chunk of m
consecutive indices (m * b <= 14 bits) gives their m values with one gather per chunk.
"""

from __future__ import annotations

import math
from functools import lru_cache

import mlx.core as mx
import numpy as np


def group_shape(bits: int) -> tuple[int, int]:
    """(values, bytes) per packing group."""
    g = math.gcd(bits, 8)
    return 8 // g, bits // g


def packed_bytes(n: int, bits: int) -> int:
    """Bytes that `n` values take (n padded up to a whole group)."""
    vals, nbytes = group_shape(bits)
    return -(-n // vals) * nbytes


@lru_cache(maxsize=None)
def _shifts(bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """(left, right, touches) for every (value, byte) pair of one group: (values, bytes) each."""
    vals, nbytes = group_shape(bits)
    o = np.arange(vals)[:, None] * bits - 8 * np.arange(nbytes)[None, :]
    touches = (o < 8) & (o + bits > 0)
    left = np.where(touches, np.maximum(o, 0), 0).astype(np.uint8)
    right = np.where(touches, np.maximum(-o, 0), 0).astype(np.uint8)
    return mx.array(left), mx.array(right), mx.array(touches)


def pack(idx: mx.array, bits: int) -> mx.array:
    """idx: (..., n) integers in [0, 2**bits) -> (..., packed_bytes(n, bits)) uint8."""
    vals, nbytes = group_shape(bits)
    n = idx.shape[-1]
    if n % 8 == 0 and bits < 8:  # 8 values fill `bits` bytes: one little-endian word per 8, then its bytes
        return _pack_words(idx, bits)
    pad = -n % vals
    v = idx.astype(mx.uint8)
    if pad:
        v = mx.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, pad)])
    left, right, touches = _shifts(bits)
    v = v.reshape(*v.shape[:-1], -1, vals, 1)  # (..., groups, values, 1)
    parts = mx.where(touches, (v >> right) << left, 0).astype(mx.uint8)  # (..., groups, values, bytes)
    out = parts.sum(axis=-2).astype(mx.uint8)  # disjoint bits: the sum is the OR
    return out.reshape(*out.shape[:-2], -1)


def _word_dtype(bits: int):
    return mx.uint32 if bits <= 4 else mx.uint64  # 8 * bits bits; 64-bit arithmetic is slow on GPUs


@lru_cache(maxsize=None)
def _word_shifts(bits: int) -> tuple[mx.array, mx.array]:
    """(value shifts (8,), byte shifts (bits,)) of the words of 8 values."""
    wide = _word_dtype(bits)
    return mx.array(bits * np.arange(8), dtype=wide), mx.array(8 * np.arange(bits), dtype=wide)


@lru_cache(maxsize=None)
def _word_bytes(bits: int):
    """Compiled (shape-free): (..., 8) values -> (..., bits) uint8 bytes of their word (sum = OR: disjoint bits)."""
    wide = _word_dtype(bits)
    value_shifts, byte_shifts = _word_shifts(bits)

    def to_bytes(v: mx.array) -> mx.array:
        word = (v.astype(wide) << value_shifts).sum(axis=-1, keepdims=True)
        return ((word >> byte_shifts) & 255).astype(mx.uint8)

    return mx.compile(to_bytes, shapeless=True)


def _pack_words(idx: mx.array, bits: int) -> mx.array:
    """`pack` for n a multiple of 8: the same bytes, with (..., n) temporaries at most."""
    n = idx.shape[-1]
    out = _word_bytes(bits)(idx.reshape(*idx.shape[:-1], n // 8, 8))
    return out.reshape(*idx.shape[:-1], n // 8 * bits)


def unpack(packed: mx.array, bits: int, n: int) -> mx.array:
    """(..., packed_bytes(n, bits)) uint8 -> (..., n) uint8 indices."""
    vals, nbytes = group_shape(bits)
    left, right, touches = _shifts(bits)
    p = packed.reshape(*packed.shape[:-1], -1, 1, nbytes)  # (..., groups, 1, bytes)
    mask = mx.array((1 << bits) - 1, dtype=mx.uint8)
    parts = mx.where(touches, ((p >> left) << right) & mask, 0).astype(mx.uint8)  # (..., groups, values, bytes)
    out = parts.sum(axis=-1).astype(mx.uint8)
    return out.reshape(*out.shape[:-2], -1)[..., :n]


def _chunk_values(bits: int) -> int:
    """Indices per table lookup: the most (a divisor of 8) that fit in 14 bits."""
    return max(m for m in (1, 2, 4, 8) if m * bits <= 14)


def chunk_table(values: np.ndarray, bits: int) -> mx.array:
    """(2**(m*bits), m) float32: the values of the m indices a chunk code holds, in packing order."""
    m = _chunk_values(bits)
    code = np.arange(2 ** (m * bits))[:, None]
    idx = (code >> (bits * np.arange(m))[None]) & ((1 << bits) - 1)
    return mx.array(values[idx].astype(np.float32))


def lookup(packed: mx.array, table: mx.array, bits: int, n: int) -> mx.array:
    """(..., packed_bytes(n, bits)) uint8 -> (..., n) float32 values, `table` from `chunk_table`."""
    m = _chunk_values(bits)
    if m * bits == 8:  # chunks are the bytes themselves
        return table[packed].reshape(*packed.shape[:-1], -1)[..., :n]
    if n % 8:  # rare head dims: unpack, then one lookup per index (row i < 2**bits starts with value i)
        return table[: 2**bits, 0][unpack(packed, bits, n)]
    # 8 indices fill `bits` bytes: one little-endian word per group (32 bits wide up to 4 bits:
    # 64-bit integer arithmetic is several times slower on GPUs), then its chunks
    wide = mx.uint32 if bits <= 4 else mx.uint64
    g = packed.reshape(*packed.shape[:-1], n // 8, bits).astype(wide)  # (..., groups, bytes)
    word = (g << mx.array(8 * np.arange(bits), dtype=wide)).sum(axis=-1)  # disjoint bits: sum = OR
    shifts = mx.array(m * bits * np.arange(8 // m), dtype=wide)
    codes = (word[..., None] >> shifts) & ((1 << (m * bits)) - 1)  # (..., groups, 8 // m)
    return table[codes].reshape(*packed.shape[:-1], n)

