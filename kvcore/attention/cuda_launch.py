"""Launch arithmetic of the CUDA decode kernel: pure Python, no device needed (unit-tested on CPU).

A `Side` says how one of K or V is stored, as a row of 32-bit words per token whose element d
sits at bits [d * bits, (d + 1) * bits) of the row's little-endian bit stream (mx.quantize's
layout for every affine width, TurboQuant's byte packing read four bytes at a time, and dense
bf16/fp16/fp32 alike). A `Plan` fixes everything the kernel is compiled for (codecs, dims, GQA
ratio, queries) and the shared memory layout; the split count and chunk are runtime values
computed from the capacity, a host int, so nothing recompiles as the context grows.

```
grid: (nsplit * NQC * THREADS, Hkv, B)   block x = split * NQC + query chunk
block: THREADS threads, `tile` tokens per tile, split = CHUNK tokens (a multiple of the tile)
```
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from .cuda_mma import MMA_TILE, mma_fits, mma_smem, turbo_form3, word_fits
from .cuda_stage import Stages, stages
from .cuda_turbo_mma import book_bytes

if TYPE_CHECKING:
    from ..codecs import CodecSpec

THREADS = 128
TILES = (128, 64, 32)  # tokens per tile (one token per thread in the score phase): the largest that fits
WARPS = THREADS // 32
MAX_QUERIES = 8  # decode and speculative verify
MAX_VECTORS = 8  # query vectors (heads x queries) one block holds in registers
TARGET_BLOCKS = int(os.environ.get("MLXKV_CUDA_TARGET_BLOCKS", str(4 * 132)))  # ~4 blocks per SM of an H200 (132 SMs)
# fewest tiles a split takes (A/B knob, default 1: splits from TARGET_BLOCKS alone): run 10 had 264 target blocks
# 10% faster at 32k (8 -> 16 tiles a split) and 11% slower at 128k (32 tiles a split either way), so a floor on a
# split's work may serve both lengths
SPLIT_TILES = max(1, int(os.environ.get("MLXKV_CUDA_SPLIT_TILES", "1")))
# splits per (row, KV head, query chunk) from TARGET_BLOCKS, rounded down (default since run 11) or up (A/B knob):
# up overshoots one wave where the rows x heads do not divide the target (16 rows x 8 heads: 5 splits, 640 blocks,
# 1.2 waves of 528; down: 4 splits, 512 blocks, 146 against 175 us a launch at 16 x 8k in run 11)
SPLIT_ROUND = os.environ.get("MLXKV_CUDA_SPLIT_ROUND", "down")
MAX_SMEM = 100 * 1024  # bytes; more would leave one block per SM
BIG = 2**30  # "no bound" in the per-row token bounds
KINDS = {"dense": 0, "affine": 1, "turbo": 2}
DENSE_TYPES = {"bfloat16": (16, 0), "float16": (16, 1), "float32": (32, 2)}  # name -> (bits, code)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _align(n: int, a: int = 16) -> int:
    return _ceil(n, a) * a


@dataclass(frozen=True)
class Side:
    """How one of K or V is stored: kind, bits per element, elements per scale group, dim."""

    kind: str  # "dense" | "affine" | "turbo"
    bits: int
    group: int
    dim: int
    dtype: str = ""  # dense element type

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown side kind {self.kind!r}")
        if self.dim % self.group or (self.dim * self.bits) % 32:
            raise ValueError(f"dim {self.dim} does not fill whole groups of {self.group} / 32-bit words")

    def __hash__(self) -> int:  # hashed on every launch (plan caches): computed once
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.kind, self.bits, self.group, self.dim, self.dtype))
            object.__setattr__(self, "_hash", h)
        return h

    @classmethod
    def dense(cls, dtype: str, dim: int) -> Side:
        return cls("dense", DENSE_TYPES[dtype][0], dim, dim, dtype)

    @property
    def words(self) -> int:
        """32-bit words per token row."""
        return self.dim * self.bits // 32

    @property
    def groups(self) -> int:
        return self.dim // self.group if self.kind == "affine" else 1

    @property
    def meta_stride(self) -> int:
        """Floats per token of staged metadata (odd, so a thread per token reads without bank conflicts)."""
        if self.kind == "affine":
            return self.groups | 1
        return 1 if self.kind == "turbo" else 0

    @property
    def codebook(self) -> int:
        return 2**self.bits if self.kind == "turbo" else 0

    @property
    def dtype_code(self) -> int:
        return DENSE_TYPES[self.dtype][1] if self.kind == "dense" else 0

    def tile_bytes(self, tile: int) -> int:
        words = tile * (self.words + 1) * 4  # rows padded by one word
        meta = tile * self.meta_stride * 4 * (2 if self.kind == "affine" else 1)
        return _align(words) + _align(meta)


def vectors_per_block(qv: int) -> int:
    """The largest divisor of the query vectors of one KV head that fits in a block (<= 8)."""
    return max(d for d in range(1, MAX_VECTORS + 1) if qv % d == 0)


PAGE = 128  # tokens per page of paged rows (kvcore/cache/paged.py): a multiple of every tile


@dataclass(frozen=True)
class Plan:
    key: Side
    value: Side
    rep: int  # query heads per KV head
    n_queries: int
    paged: bool = False  # K/V in pages (P, H', PAGE, ...) found through a block table per row
    mma: int = 0  # the tensor-core body (kvcore/attention/cuda_mma.py; `mma_fits` says where), 2: its staged form,
    # 3: keys-as-A with form 1's loads (cuda_form3.py; form 1's shared memory and constants), 4: form 3's lean loop
    # through form 2's ring (cuda_ring.py; form 2's ring and constants)
    rotate: bool = False  # turbo sides: the query rotated and the output rotated back in the launch (cuda_rotate.py)

    def __hash__(self) -> int:
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.key, self.value, self.rep, self.n_queries, self.paged, self.mma, self.rotate))
            object.__setattr__(self, "_hash", h)
        return h

    def __post_init__(self):
        if not 1 <= self.n_queries <= MAX_QUERIES:
            raise ValueError(f"the kernel takes 1..{MAX_QUERIES} queries, got {self.n_queries}")

    @cached_property
    def qv(self) -> int:
        return self.rep * self.n_queries  # query vectors per KV head: v = r * n_queries + n

    @cached_property
    def qvb(self) -> int:
        return vectors_per_block(self.qv)

    @cached_property
    def nqc(self) -> int:
        return self.qv // self.qvb

    @cached_property
    def qvp(self) -> int:
        return _ceil(self.qvb, 4) * 4  # padded for float4 reads

    @cached_property
    def ve(self) -> int:
        """Value elements per thread in the value phase."""
        return 8 if self.qvb <= 4 else 4

    @cached_property
    def tpr(self) -> int:
        return self.value.dim // self.ve  # threads per value row

    @cached_property
    def ts(self) -> int:
        return THREADS // self.tpr  # token subsets in the value phase

    @cached_property
    def tile(self) -> int:
        if self.mma:
            return MMA_TILE
        return next((t for t in TILES if self._layout(t)["TOTAL"] <= MAX_SMEM), TILES[0])

    @cached_property
    def stages(self) -> Stages:
        """The staged form's per-warp ring (cuda_stage.py)."""
        k, v = self.key, self.value
        return stages(k.words, v.words, k.groups, v.groups, WARPS)

    @cached_property
    def layout(self) -> dict:
        """Byte offsets of the shared memory regions, and the total."""
        return self._layout(self.tile)

    def _layout(self, tile: int) -> dict:
        if self.mma:  # the warps' partials, then the merge's weights (scratch at 0); form 2: the rings before them
            rings = WARPS * self.stages.count * self.stages.stage if self.mma in (2, 4) else 0
            total = max(rings, mma_smem(self.qvb, self.value.dim, WARPS))
            if self.key.kind == "turbo":  # the codebooks (fp16) after the partials (cuda_turbo_mma.py)
                return {"KT": 0, "BOOK": _align(total), "TOTAL": _align(total) + book_bytes(self.key.bits, self.value.bits)}
            return {"KT": 0, "TOTAL": total}
        k, v = self.key, self.value
        sizes = [
            ("Q", k.dim * self.qvp * 4),
            ("QSUM", k.groups * self.qvp * 4 if k.kind == "affine" else 0),
            ("KCB", k.codebook * 4),
            ("VCB", v.codebook * 4),
            ("RED", WARPS * self.qvp * 4),
            ("P", tile * self.qvp * 4),
        ]
        off, out = 0, {}
        for name, size in sizes:
            out[name] = off
            off += _align(size)
        union = off
        for name, side in (("K", k), ("V", v)):
            out[name + "T"] = off
            out[name + "M"] = off + _align(tile * (side.words + 1) * 4)
            off += side.tile_bytes(tile)
        scratch = self.ts * self.qvb * v.dim * 4  # per token subset partial outputs, after the last tile
        out["TOTAL"] = max(off, union + _align(scratch))
        return out

    @property
    def smem(self) -> int:
        return self.layout["TOTAL"]

    def merges_in_launch(self, nsplit: int) -> bool:
        """Whether the launch's last block can merge `nsplit` splits itself: their weights and the
        denominators (QVB x (nsplit + 1) floats; a rotating plan's outputs after them) fit the shared memory
        after the tiles."""
        extra = self.qvb * self.value.dim if self.rotate else 0
        return (self.qvb * (nsplit + 1) + extra) * 4 <= self.smem - self.layout["KT"] and self.value.dim % 4 == 0

    def why_not(self) -> str | None:
        """None when the kernel covers this plan, else why not."""
        if self.value.dim % self.ve or THREADS % self.tpr or self.tpr > THREADS:
            return f"value dim {self.value.dim} does not map onto {THREADS} threads"
        if not (32 <= self.key.dim <= 256 and 32 <= self.value.dim <= 256):
            return "head dims outside 32..256"
        if self.mma and not mma_fits(self.key, self.value, self.rep, self.n_queries, "float16"):
            return "the tensor-core body does not cover these sides"
        turbo3 = self.key.kind == "turbo" and self.mma == 3 and turbo_form3()  # cuda_turbo3.py (opt-in)
        if self.mma not in (0, 1) and not turbo3 and (self.key.kind == "turbo" or not word_fits(self.key, self.value)):
            return "turbo rows and affine code chunks take the tensor-core body's form 1 only"
        if self.smem > MAX_SMEM:
            return f"shared memory {self.smem} > {MAX_SMEM}"
        if self.rotate and not (self.mma and self.key.kind == self.value.kind == "turbo" and self.key.dim == self.value.dim
                                and self.key.dim & (self.key.dim - 1) == 0):
            return "the launch rotates turbo rows of one power-of-two dim on the tensor cores only"
        return None

    @cached_property
    def template(self) -> list[tuple[str, int]]:
        k, v = self.key, self.value
        t = [("D", k.dim), ("DV", v.dim), ("REP", self.rep), ("NQ", self.n_queries), ("QVB", self.qvb),
             ("NQC", self.nqc), ("QVP", self.qvp), ("VE", self.ve), ("TPR", self.tpr), ("TS", self.ts),
             ("THREADS", THREADS), ("TT", self.tile),
             ("KK", KINDS[k.kind]), ("KB", k.bits), ("KG", k.group), ("KNG", k.groups), ("KRW", k.words),
             ("KMS", k.meta_stride), ("KDT", k.dtype_code),
             ("VK", KINDS[v.kind]), ("VB", v.bits), ("VG", v.group), ("VNG", v.groups), ("VRW", v.words),
             ("VMS", v.meta_stride), ("VDT", v.dtype_code), ("PAGED", self.paged), ("PAGE", PAGE),
             ("MMA", int(self.mma))]
        if k.kind == "turbo":  # the turbo bodies' rotation in the launch (cuda_rotate.py)
            t.append(("ROT", int(self.rotate)))
        if self.mma in (2, 4):  # the ring's strides, depth and stage offsets (cuda_stage.py)
            st = self.stages
            t += [("KRS", st.krs), ("VRS", st.vrs), ("STG", st.count), ("STB", st.stage)]
            t += [("SOFF_" + name, off) for name, off in st.offsets(k.groups, v.groups).items()]
        return t + [("OFF_" + name, off) for name, off in self.layout.items() if name != "TOTAL"]

    def splits(self, columns: int, rows: int, heads: int, split_tiles: int = SPLIT_TILES,
               round_: str = SPLIT_ROUND) -> tuple[int, int]:
        """(chunk, nsplit) for `columns` tokens at most per row (a host int: capacity or length):
        enough blocks to fill the device, each split a whole number of tiles, at least `split_tiles` of them
        where that still gives every SM a block (TARGET_BLOCKS / 4 of them)."""
        tiles = max(1, _ceil(columns, self.tile))
        groups = rows * heads * self.nqc
        floor = max(tiles // split_tiles, _ceil(TARGET_BLOCKS // 4, groups))  # the floor never leaves an SM idle
        target = max(1, TARGET_BLOCKS // groups) if round_ == "down" else _ceil(TARGET_BLOCKS, groups)
        want = min(target, floor)
        per = _ceil(tiles, min(max(want, 1), tiles))  # tiles per split
        return per * self.tile, _ceil(tiles, per)

    def grid(self, nsplit: int, heads: int, rows: int) -> tuple[int, int, int]:
        return (nsplit * self.nqc * THREADS, heads, rows)

    def partial_shapes(self, rows: int, heads: int, nsplit: int) -> list[tuple[int, ...]]:
        """m, l: (B, Hkv, S, QV); acc: (B, Hkv, S, QV, DV)."""
        return [(rows, heads, nsplit, self.qv), (rows, heads, nsplit, self.qv),
                (rows, heads, nsplit, self.qv, self.value.dim)]


def token_bounds(q_start: int, n_queries: int, seg_start: int, seg_length: int, *, window: int | None, keep: int,
                 kind: str, block_tokens: int, lag: int) -> tuple[int, int, int] | None:
    """(lo0, hi0, count) in segment columns: query n sees columns [max(lo0 + n, 0), min(hi0 + n, count)).

    The same rule as `Segment.visible` for one-token blocks: causal, a window's lower bound
    (tokens before `keep` always seen), a recent-token lag (encoded: read from `lag` positions
    after a token on; shadow: before). None where that is not an interval per query."""
    del n_queries  # the bounds move by one column per query
    lo, hi = -BIG, q_start + 1
    if window is not None:
        if seg_start >= keep:
            lo = q_start - (window - keep) + 1
        elif seg_start + seg_length > keep:
            return None
    if kind != "dense" and (block_tokens > 1 or lag):
        if block_tokens > 1:
            return None
        if kind == "encoded":
            hi = q_start + 1 - lag
        else:  # shadow
            lo = max(lo, q_start - lag + 1)
    shift = lambda x: x if x == -BIG else x - seg_start
    return shift(lo), hi - seg_start, seg_length


def describe(plan: Plan, q_dtype: str = "") -> str:
    """A plan (and query dtype) as the admission verdicts and the tests name it."""
    def side(s: Side) -> str:
        return s.dtype if s.kind == "dense" else f"{s.kind}{s.bits}" + (f"/g{s.group}" if s.kind == "affine" else "")

    return (f"K {side(plan.key)} d{plan.key.dim} V {side(plan.value)} d{plan.value.dim} rep{plan.rep} "
            f"n{plan.n_queries}" + (f" q {q_dtype}" if q_dtype else ""))


def spec_side(spec: CodecSpec, dim: int) -> Side:
    """The side a codec spec is stored as (for scripts that build plans)."""
    if spec.name == "affine":
        return Side("affine", spec.bits, spec.group_size or 64, dim)
    return Side("turbo", spec.bits, dim, dim)
