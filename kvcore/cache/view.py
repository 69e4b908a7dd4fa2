"""What a compressed cache hands to attention: its stored tokens as segments.

A segment is a run of consecutive true token positions stored one way:

```
position:  0 .. keep-1 | enc_start ............ | tail_start ... offset-1
segment:   keep (dense)| encoded blocks         | tail (dense)
                       | shadow: dense copy of the blocks encoded by this update
```
Which query sees which column is decided from positions alone (see `visible`), so the
result of attention never depends on how the prompt was chunked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

DENSE, ENCODED, SHADOW = "dense", "encoded", "shadow"
SPARE_TOKENS = 256  # a whole-buffer decode may read this much spare capacity (one growth step)


@dataclass(frozen=True)
class Joint:
    """K and V encoded by one codec into one set of arrays, K's heads first:

    ```
    arrays[i]: (B, 2H, capacity, ...)   heads [0, H) keys, [H, 2H) values; blocks [0, n) stored
    ```
    One quantize and one write per part serve both (a decode step writes 3 arrays, not 6), and
    one decode call reads both. `arrays` are the buffers as stored, spare capacity included."""

    arrays: tuple
    heads: int

    @property
    def capacity(self) -> int:
        return self.arrays[0].shape[2]

    @staticmethod
    def spare_blocks(block_tokens: int) -> int:
        return max(1, SPARE_TOKENS // block_tokens)

    def halves(self, blocks: int) -> tuple[tuple, tuple]:
        """(key parts, value parts) of the first `blocks` blocks: views, nothing copied."""
        H = self.heads
        return (tuple(a[:, :H, :blocks] for a in self.arrays), tuple(a[:, H:, :blocks] for a in self.arrays))


@dataclass
class Segment:
    kind: str  # DENSE | ENCODED | SHADOW
    keys: Any  # dense (B, H, T, D) or codec-encoded tuple (block axis 2)
    values: Any
    start: int  # true position of the first column
    length: int  # columns (tokens)
    block_tokens: int = 1
    key_codec: Any = None
    value_codec: Any = None
    lag: int = 0  # ENCODED/SHADOW: positions after a block's last token before it is read encoded
    rotation: Any = None  # set: dense() returns R k, R v (attention in a rotation codec's basis)
    joint: Joint | None = None  # ENCODED, K and V stored in one set of arrays (keys, values: None)

    def parts(self) -> tuple[Any, Any]:
        """(keys, values) as stored: dense arrays, or the codec's encoded parts of the stored
        blocks (for joint storage, views of its K and V halves)."""
        if self.joint is None:
            return self.keys, self.values
        return self.joint.halves(-(-self.length // self.block_tokens))

    def dense(self, lo: int, hi: int, dtype: mx.Dtype, spare_ok: bool = False) -> tuple[mx.array, mx.array]:
        """Columns [lo, hi) of this segment as dense (B, H, hi-lo, D) keys and values.
        `spare_ok`: a whole joint segment may be decoded with its buffer's spare capacity (the
        arrays as stored are contiguous, so the decode reads them in place instead of copying a
        slice first); the result is still sliced to [lo, hi)."""
        if self.rotation is not None:
            return self._rotated(lo, hi, dtype)
        if self.kind != ENCODED:
            return self.keys[:, :, lo:hi], self.values[:, :, lo:hi]
        bt = self.block_tokens
        b0, b1 = lo // bt, (hi + bt - 1) // bt
        cut = lo - b0 * bt
        if self.joint is not None:
            j = self.joint
            whole = spare_ok and b0 == 0 and j.capacity - b1 <= j.spare_blocks(bt)
            x = self.key_codec.decode(j.arrays if whole else tuple(a[:, :, b0:b1] for a in j.arrays), dtype)
            return x[:, : j.heads, cut : cut + hi - lo], x[:, j.heads :, cut : cut + hi - lo]
        k = self.key_codec.decode(tuple(a[:, :, b0:b1] for a in self.keys), dtype)
        v = self.value_codec.decode(tuple(a[:, :, b0:b1] for a in self.values), dtype)
        return k[:, :, cut : cut + hi - lo], v[:, :, cut : cut + hi - lo]

    def _rotated(self, lo: int, hi: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        if self.kind != ENCODED:
            r = self.rotation
            return r.forward(self.keys[:, :, lo:hi]).astype(dtype), r.forward(self.values[:, :, lo:hi]).astype(dtype)
        b0, b1 = lo, hi  # rotation codecs store one token per block
        keys, values = self.parts()
        k = self.key_codec.decode_rotated(tuple(a[:, :, b0:b1] for a in keys), dtype)
        v = self.value_codec.decode_rotated(tuple(a[:, :, b0:b1] for a in values), dtype)
        return k, v

    def visible(self, q_pos: mx.array, lo: int, hi: int, window: int | None, keep: int) -> mx.array:
        """(N, hi-lo) bool: may the query at q_pos[n] attend to column j of this segment."""
        j = mx.arange(self.start + lo, self.start + hi)[None]
        q = q_pos[:, None]
        mask = j <= q
        if window is not None:
            mask = mask & ((j < keep) | (q - j < window - keep))
        if self.kind != DENSE and (self.block_tokens > 1 or self.lag):
            # a block is read encoded from the query `lag` positions after its last one on
            last = self.start + (j - self.start) // self.block_tokens * self.block_tokens
            last = last + self.block_tokens - 1 + self.lag
            mask = mask & ((q >= last) if self.kind == ENCODED else (q < last))
        return mask


@dataclass
class KVView:
    """Returned by a compressed cache's `update_and_fetch`, as both keys and values."""

    segments: list[Segment]
    q_start: int  # true position of the first query of this update
    n_queries: int
    window: int | None
    keep: int
    batch: int
    heads: int
    head_dim: int
    value_dim: int
    config: Any = None  # the cache's AttentionConfig (None: the default)
    stats: Any = None  # the cache set's AttentionStats
    memo: dict | None = None  # the cache's own: what attention derives from its settings alone, kept between steps
    launch: Any = None  # a steady layer's kernel launch kept in its memo (cuda_decode.kept_launch): tried first

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.heads, sum(s.length for s in self.segments), self.head_dim)

    @property
    def steady(self) -> bool:
        """A plain compressed layer's decode view: one encoded segment of one-token blocks, read
        encoded from the query on (no window, sink, recent or dense tokens)."""
        if len(self.segments) != 1 or self.window is not None:
            return False
        s = self.segments[0]
        return s.kind == ENCODED and s.block_tokens == 1 and not s.lag

    @property
    def q_positions(self) -> mx.array:
        return mx.arange(self.q_start, self.q_start + self.n_queries)


@dataclass
class BatchKVView:
    """One KVView per row (None where a row's update was all padding).

    Row b's queries are columns [skips[b], n_columns) of the update; the padding columns
    before them get zeros from attention.
    """

    rows: list
    skips: list[int]
    n_columns: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        live = [v for v in self.rows if v is not None]
        B, H, _, D = live[0].shape
        return (len(self.rows), H, max(v.shape[2] for v in live), D)
