"""Fused decode attention over compressed KV on CUDA (`mx.fast.cuda_kernel`), beside the portable path.

For up to 8 queries per row (decode, speculative verify) over per-token K/V: every stored
segment of a view (encoded affine 2-8 bits or TurboQuant in the rotated basis, dense sink /
recent / shadow tokens, full-precision packed rows) is one launch of the kernel in
`cuda_source.py`, which reads each packed byte once (a tile of consecutive token rows per
block, coalesced), dequantizes in registers, serves all query heads of a KV head (GQA) and
writes a partial softmax per split of the length; one merge launch combines the splits of
every segment (flash decoding) and the attention sinks. Nothing syncs with the host: the
split count comes from host ints (the buffer capacity, a segment's length), row lengths and
bounds are device inputs, and the arrays are read in place through their strides.

Selected at run time: only on CUDA, when the caches' AttentionConfig has `cuda_kernel`, and
only for a plan (codecs, bits, head dims, GQA ratio, queries, query dtype) that passed a check
against a float32 reference on the device the first time it was asked for (the verdict is
kept per plan); anything else returns None and the portable path serves.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import mlx.core as mx

from ..backend import backend_name
from ..cache.packed import per_step
from ..cache.view import DENSE, ENCODED
from ..codecs import CodecSpec
from ..codecs.affine import AffineCodec
from ..codecs.turbo import TurboCodec
from . import cuda_source as src
from .cuda_launch import (
    BIG,
    DENSE_TYPES,
    MAX_QUERIES,
    THREADS,
    Plan,
    Side,
    token_bounds,
)

_KERNELS: dict = {}
_VERDICTS: dict = {}  # (plan, q dtype name) -> None (admitted) or the reason it is not
_CONST: dict = {}
Q_TYPES = (mx.bfloat16, mx.float16, mx.float32)


@cache
def _dtype_name(dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


@dataclass
class Launch:
    """One segment's kernel launch: how K/V are stored, their arrays, the rows' token bounds."""

    key: Side
    value: Side
    k_arrays: tuple  # (words, scales, biases), dummies where a side has none
    v_arrays: tuple
    k_book: mx.array
    v_book: mx.array
    rows: mx.array  # (B, 3) int32: lo0, hi0, count (columns of this segment)
    columns: int  # most tokens a row holds here (host int): sizes the splits
    v_head: int = 0  # the value arrays' first head (joint storage: the key arrays, from head Hkv on)


def _const(key, make):
    if key not in _CONST:
        _CONST[key] = make()
    return _CONST[key]


def _dummy(dtype=mx.float16) -> mx.array:
    return _const(("dummy", dtype), lambda: mx.zeros((1,), dtype=dtype))


_ROWS: dict = {}


def _rows(bounds: tuple, B: int) -> mx.array:
    """(B, 3) int32 token bounds, shared by every layer of a step (a view's bounds repeat across layers):
    built on the device from three scalars, so no host-written page is migrated per call."""
    key = (bounds, B)
    r = _ROWS.get(key)
    if r is None:
        if len(_ROWS) > 64:
            _ROWS.clear()
        r = mx.stack([mx.array(x, dtype=mx.int32) for x in bounds])[None]
        r = _ROWS[key] = r if B == 1 else mx.repeat(r, B, axis=0)
    return r


def _ints(*xs: int) -> mx.array:
    return _const(("ints", xs), lambda: mx.array(xs, dtype=mx.int32))


def _codec_side(codec, dim: int, rotated: bool) -> tuple[Side, mx.array] | None:
    """(side, codebook) for a codec the kernel reads, else None."""
    side = _side_for(type(codec), codec.bits, getattr(codec, "group", 0), getattr(codec, "layout", ""), dim, rotated)
    if side is None:
        return None
    return side, (codec.centroids if side.kind == "turbo" else _dummy(mx.float32))


@cache
def _side_for(cls, bits: int, group: int, layout: str, dim: int, rotated: bool) -> Side | None:
    if cls is AffineCodec and layout == "channel":
        return Side("affine", bits, group, dim)
    if cls is TurboCodec and rotated and (dim * bits) % 32 == 0:
        return Side("turbo", bits, dim, dim)
    return None


def _codec_arrays(side: Side, parts: tuple) -> tuple | None:
    if side.kind == "affine":
        w, s, b = parts
        ok = w.dtype == mx.uint32 and s.dtype == mx.float16 and b.dtype == mx.float16
        return (w, s, b) if ok else None
    packed, norm = parts
    return (packed, norm, _dummy()) if packed.dtype == mx.uint8 and norm.dtype == mx.float16 else None


def _dense_side(x: mx.array) -> Side | None:
    return _dense_for(x.dtype, x.shape[-1])


@cache
def _dense_for(dtype, dim: int) -> Side | None:
    name = _dtype_name(dtype)
    return Side.dense(name, dim) if name in DENSE_TYPES and dim % 32 == 0 else None


def _sides(key_codec, value_codec, keys, values, dims, rotated):
    """(key side, value side, key arrays, value arrays, books) or None."""
    if key_codec is None and value_codec is None:
        ks, vs = _dense_side(keys[0]), _dense_side(values[0])
        if ks is None or vs is None:
            return None
        return ks, vs, (keys[0], _dummy(), _dummy()), (values[0], _dummy(), _dummy()), _dummy(mx.float32), _dummy(mx.float32)
    if key_codec is None or value_codec is None:
        return None
    k, v = _codec_side(key_codec, dims[0], rotated), _codec_side(value_codec, dims[1], rotated)
    if k is None or v is None:
        return None
    ka, va = _codec_arrays(k[0], keys), _codec_arrays(v[0], values)
    if ka is None or va is None:
        return None
    return k[0], v[0], ka, va, k[1], v[1]


def _rotation_ok(rotation, *codecs) -> bool:
    """Turbo is read in the rotated basis only: the view's rotation must be the codecs' own."""
    return all(rotation is None or getattr(c, "rotation", None) is rotation for c in codecs if c is not None)


def _joint_sides(joint) -> tuple[tuple, tuple, int]:
    """Key arrays, value arrays and the values' first head of joint storage, read in place by
    strides: the kernel's grid covers heads [0, H), so the same arrays serve K and V, V from head H."""
    return joint.arrays, joint.arrays, joint.heads


def view_launches(q: mx.array, view) -> list[Launch] | None:
    """A KVView's segments as launches, or None where one is not covered."""
    B, N = q.shape[0], q.shape[2]
    if view.window is None and all(s.kind == DENSE for s in view.segments):
        return None  # full precision, causal: MLX's fused SDPA needs no array mask here
    out = []
    for seg in view.segments:
        if seg.length == 0:
            continue
        bounds = token_bounds(view.q_start, N, seg.start, seg.length, window=view.window, keep=view.keep,
                              kind=seg.kind, block_tokens=seg.block_tokens, lag=seg.lag)
        if bounds is None:
            return None
        if seg.kind == ENCODED:
            if seg.block_tokens != 1 or not _rotation_ok(seg.rotation, seg.key_codec, seg.value_codec):
                return None
            keys, values, vh = (seg.keys, seg.values, 0) if seg.joint is None else _joint_sides(seg.joint)
            sides = _sides(seg.key_codec, seg.value_codec, keys, values, (view.head_dim, view.value_dim),
                           seg.rotation is not None)
        else:
            k, v, vh = seg.keys, seg.values, 0
            if seg.rotation is not None:  # dense tokens attend in the rotated basis too (few: sinks, recent)
                k, v = seg.rotation.forward(k), seg.rotation.forward(v)
            sides = _sides(None, None, (k,), (v,), None, False)
        if sides is None:
            return None
        out.append(Launch(*sides, _rows(bounds, B), seg.length, vh))
    return out or None


def packed_launches(q: mx.array, view) -> list[Launch] | None:
    """A PackedView (rows of one layer in shared buffers (B, H, capacity, ...)) as one launch."""
    if not _rotation_ok(view.rotation, view.key_codec, view.value_codec):
        return None
    keys, values, vh = (view.key_parts, view.value_parts, 0) if view.joint is None else _joint_sides(view.joint)
    sides = _sides(view.key_codec, view.value_codec, keys, values, (view.head_dim, view.value_dim),
                   view.rotation is not None)
    if sides is None:
        return None
    return [Launch(*sides, _packed_rows(view.q_start, view.n_queries), view.capacity, vh)]


def _packed_rows(q_start: mx.array, n_queries: int) -> mx.array:
    """(B, 3) bounds (-BIG, q + 1, q + N) of packed rows, made once per step (cache.packed.per_step)."""
    def make():
        qs = q_start.astype(mx.int32)
        return mx.stack([mx.full(qs.shape, -BIG, dtype=mx.int32), qs + 1, qs + n_queries], axis=1)

    return per_step("kernel rows", q_start, n_queries, make)


@cache
def plan_for(key: Side, value: Side, rep: int, n_queries: int) -> Plan:
    return Plan(key, value, rep, n_queries)


def _source_constants(consts) -> str:
    """Compile-time constants as source lines: the kernel text of a plan carries them, so a call
    passes no template (MLX formats every template argument into the source on every call)."""
    out = []
    for name, value in consts:
        if isinstance(value, bool):
            out.append(f"constexpr bool {name} = {'true' if value else 'false'};")
        elif isinstance(value, int):
            out.append(f"constexpr int {name} = {value};")
        else:
            out.append(f"using {name} = {value};")
    return "\n".join(out) + "\n"


_CTYPES = {"bfloat16": "__nv_bfloat16", "float16": "__half", "float32": "float"}


def _kernel(plan: Plan, fused: bool, has_sink: bool, out_dtype):
    """The decode kernel object for a plan (its constants in its source), made once."""
    key = ("decode", plan, fused, has_sink, out_dtype)
    k = _KERNELS.get(key)
    if k is None:
        consts = [*plan.template, ("FUSED", fused), ("HAS_SINK", has_sink), ("OT", _CTYPES[_dtype_name(out_dtype)])]
        k = _KERNELS[key] = mx.fast.cuda_kernel(
            name=f"mlxkv_decode_{len(_KERNELS)}", input_names=src.INPUTS, output_names=src.OUTPUTS,
            source=_source_constants(consts) + src.compact(src.SOURCE), header=_header(),
            ensure_row_contiguous=False, shared_memory=plan.smem)
    return k


@cache
def _header() -> str:
    return src.compact(src.HEADER)


def _merge_kernel():
    k = _KERNELS.get("merge")
    if k is None:
        k = _KERNELS["merge"] = mx.fast.cuda_kernel(
            name="mlxkv_merge", input_names=src.MERGE_INPUTS, output_names=src.MERGE_OUTPUTS,
            source=src.compact(src.MERGE_SOURCE), ensure_row_contiguous=True)
    return k


# the split counters of fused launches: a ring of slots, each launch takes the next one, so
# launches that may run at once (no data dependency between them) never share a counter
RING_SLOTS = 1024
SLOT = 1024  # counters per slot: rows x KV heads x query chunks of one launch, at most
_RING = {"next": 0}


def _counters() -> mx.array:
    return _const(("ctr",), lambda: mx.zeros((RING_SLOTS * SLOT,), dtype=mx.int32))


def _next_slot() -> int:
    i = _RING["next"]
    _RING["next"] = (i + 1) % RING_SLOTS
    return i * SLOT


@cache
def _geometry(plan: Plan, B: int, heads: int, columns_tiles: int) -> tuple:
    """(chunk, nsplit, grid, partial shapes) of one launch (cached: a step repeats them per layer)."""
    chunk, nsplit = plan.splits(columns_tiles * plan.tile, B, heads)
    return chunk, nsplit, plan.grid(nsplit, heads, B), plan.partial_shapes(B, heads, nsplit)


def _sinks(sinks: mx.array | None) -> mx.array:
    """The sinks' logits as the kernels read them: float32 (Hq,), a dummy when there are none."""
    return _dummy(mx.float32) if sinks is None else sinks.astype(mx.float32).reshape(-1)


def _scale(scale: float) -> mx.array:
    return _const(("scale", scale), lambda: mx.array([scale], dtype=mx.float32))


def partials(q: mx.array, launch: Launch, plan: Plan, scale: float, heads: int, split: tuple[int, int] | None = None,
             sinks: mx.array | None = None, fused: bool = False):
    """One launch: (m, l, acc) partial softmax per split, shapes from `Plan.partial_shapes`, and
    with `fused` the merged output (B, Hq, N, Dv) in q's dtype as a fourth array."""
    B, Hq, N, _ = q.shape
    if split is None:
        chunk, nsplit, grid, shapes = _geometry(plan, B, heads, -(-launch.columns // plan.tile))
    else:
        (chunk, nsplit), grid, shapes = split, plan.grid(split[1], heads, B), plan.partial_shapes(B, heads, split[1])
    base = _next_slot() if fused else 0
    sk = _sinks(sinks)
    return _kernel(plan, fused, sinks is not None, q.dtype)(
        inputs=[q, *launch.k_arrays, *launch.v_arrays, launch.k_book, launch.v_book, launch.rows,
                _ints(chunk, nsplit, launch.v_head), _scale(scale),
                _counters() if fused else _dummy(mx.int32), _ints(base), sk],
        grid=grid, threadgroup=(THREADS, 1, 1),
        output_shapes=[*shapes, (B, Hq, N, plan.value.dim) if fused else (1,)],
        output_dtypes=[mx.float32] * 3 + [q.dtype],
    )


def merge(q: mx.array, parts: list, rep: int, value_dim: int, sinks: mx.array | None) -> mx.array:
    """Combine the splits of every launch (and the sinks' logits) -> (B, Hq, N, Dv) in q's dtype."""
    B, Hq, N, _ = q.shape
    m, l, acc = (mx.concatenate([p[i] for p in parts], axis=2) if len(parts) > 1 else parts[0][i] for i in range(3))
    sk = _sinks(sinks)
    return _merge_kernel()(
        inputs=[m, l, acc, sk, _ints(0, m.shape[2])],
        template=[("REP", rep), ("NQ", N), ("DV", value_dim), ("HAS_SINK", sinks is not None), ("OT", q.dtype)],
        grid=(value_dim, Hq * N, B), threadgroup=(value_dim, 1, 1),
        output_shapes=[(B, Hq, N, value_dim)], output_dtypes=[q.dtype],
    )[0]


def fusable(plan: Plan, B: int, heads: int, columns: int) -> bool:
    """Whether one launch merges its own splits (its counters fit a slot of the ring, the split
    weights its shared memory)."""
    nsplit = _geometry(plan, B, heads, -(-columns // plan.tile))[1]
    return B * heads * plan.nqc <= SLOT and plan.merges_in_launch(nsplit)


def attend(q: mx.array, launches: list[Launch] | None, heads: int, scale: float, sinks) -> mx.array | None:
    """The kernel's attention for these launches, or None where a plan is not admitted. One
    launch merges its own splits; several (segments of a view) are merged by one more launch."""
    if not launches or backend_name() != "cuda":
        return None
    B, Hq, N, _ = q.shape
    if N > MAX_QUERIES or Hq % heads or q.dtype not in Q_TYPES:
        return None
    rep = Hq // heads
    plans = [plan_for(L.key, L.value, rep, N) for L in launches]
    if any(not admitted(p, q.dtype) for p in plans) or len({p.value.dim for p in plans}) > 1:
        return None
    if len(launches) == 1 and fusable(plans[0], B, heads, launches[0].columns):
        return partials(q, launches[0], plans[0], scale, heads, sinks=sinks, fused=True)[3]
    parts = [partials(q, L, p, scale, heads) for L, p in zip(launches, plans)]
    return merge(q, parts, rep, plans[0].value.dim, sinks)


def view_attention(q: mx.array, view, scale: float, sinks=None) -> mx.array | None:
    """kv_attention's kernel branch for a KVView: the output, or None (the portable path serves)."""
    if backend_name() != "cuda" or q.shape[2] > MAX_QUERIES:
        return None
    return attend(q, view_launches(q, view), view.heads, scale, sinks)


def packed_attention(q: mx.array, view, scale: float, sinks=None) -> mx.array | None:
    """packed_attention's kernel branch for a PackedView: the output, or None."""
    if backend_name() != "cuda" or q.shape[2] > MAX_QUERIES:
        return None
    return attend(q, packed_launches(q, view), view.heads, scale, sinks)


# -- admission: each plan checked once on the device ---------------------------------------------
def admitted(plan: Plan, q_dtype) -> bool:
    key = (plan, _dtype_name(q_dtype))
    if _VERDICTS.get(key, 0) is None:
        return True
    if key not in _VERDICTS:
        why = plan.why_not()
        if why is None:
            from .cuda_check import check_plan

            try:
                why = check_plan(plan, q_dtype)
            except Exception as e:  # noqa: BLE001 - a kernel that cannot build or run here: the portable path serves
                why = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        _VERDICTS[key] = why
    return _VERDICTS[key] is None


def status() -> dict:
    """Every plan asked for so far and its verdict (None: admitted)."""
    return {describe(p, dt): why for (p, dt), why in _VERDICTS.items()}


def describe(plan: Plan, q_dtype: str = "") -> str:
    def side(s: Side) -> str:
        return s.dtype if s.kind == "dense" else f"{s.kind}{s.bits}" + (f"/g{s.group}" if s.kind == "affine" else "")

    return (f"K {side(plan.key)} d{plan.key.dim} V {side(plan.value)} d{plan.value.dim} rep{plan.rep} "
            f"n{plan.n_queries}" + (f" q {q_dtype}" if q_dtype else ""))


def applies(q: mx.array, key_codec, value_codec) -> bool:
    """Whether the kernel reads these codecs here, outside a rotated basis (CUDA only)."""
    if backend_name() != "cuda" or q.shape[2] > MAX_QUERIES:
        return False
    return all(c is not None and _codec_side(c, c.head_dim, False) is not None for c in (key_codec, value_codec))


def spec_side(spec: CodecSpec, dim: int) -> Side:
    """The side a codec spec is stored as (for scripts that build plans)."""
    if spec.name == "affine":
        return Side("affine", spec.bits, spec.group_size or 64, dim)
    return Side("turbo", spec.bits, dim, dim)


# -- the earlier entry points (scripts/gpu_check.py) ----------------------------------------------
def ready() -> bool:
    return backend_name() == "cuda"


def decode_attention(q: mx.array, key_parts, value_parts, codec, lengths: mx.array, scale: float) -> mx.array:
    """q: (B, Hq, N, D); parts (B, Hkv, CAP, ...) with row b valid on [0, lengths[b]) -> (B, Hq, N, Dv)."""
    from ..errors import MlxkvError

    sides = _sides(codec, codec, key_parts, value_parts, (q.shape[-1], codec.head_dim), False)
    N = q.shape[2]
    n = lengths.astype(mx.int32)
    rows = mx.stack([mx.full(n.shape, -BIG, dtype=mx.int32), n - N + 1, n], axis=1)
    out = attend(q, None if sides is None else [Launch(*sides, rows, key_parts[0].shape[2])],
                 key_parts[0].shape[1], scale, None)
    if out is None:
        raise MlxkvError("the CUDA decode kernel does not cover this case here")
    return out
