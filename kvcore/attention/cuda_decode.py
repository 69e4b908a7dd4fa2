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

from dataclasses import replace
from functools import cache

import mlx.core as mx

from ..backend import Verdicts, backend_name, unpooled
from ..cache.packed import per_step
from ..cache.view import DENSE, ENCODED, Joint
from ..codecs.affine import AffineCodec
from ..codecs.turbo import TurboCodec
from .config import DEFAULT
from .cuda_kernels import (
    Q_TYPES,
    Launch,
    arrays_launch,
    dtype_name,
    dummy,
    fusable,
    joint_launch,
    merge,
    partials,
    token_offsets_fit,
)
from .cuda_launch import (
    BIG,
    DENSE_TYPES,
    MAX_QUERIES,
    PAGE,
    Plan,
    Side,
    describe,
    spec_side,
    token_bounds,
)
from . import cuda_rotate
from .cuda_mma import form_for, mma_fits
from .rotated import rotate_view

_VERDICTS = Verdicts("decode")  # (plan, q dtype name) -> None (admitted) or the reason it is not


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


def _codec_side(codec, dim: int, rotated: bool) -> tuple[Side, mx.array] | None:
    """(side, codebook) for a codec the kernel reads, else None."""
    side = _side_for(type(codec), codec.bits, getattr(codec, "group", 0), getattr(codec, "layout", ""), dim, rotated)
    if side is None:
        return None
    return side, (unpooled(codec.centroids) if side.kind == "turbo" else dummy(mx.float32))


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
    return (packed, norm, dummy()) if packed.dtype == mx.uint8 and norm.dtype == mx.float16 else None


def _dense_side(x: mx.array) -> Side | None:
    return _dense_for(x.dtype, x.shape[-1])


@cache
def _dense_for(dtype, dim: int) -> Side | None:
    name = dtype_name(dtype)
    return Side.dense(name, dim) if name in DENSE_TYPES and dim % 32 == 0 else None


def _sides(key_codec, value_codec, keys, values, dims, rotated):
    """(key side, value side, key arrays, value arrays, books) or None."""
    if key_codec is None and value_codec is None:
        ks, vs = _dense_side(keys[0]), _dense_side(values[0])
        if ks is None or vs is None:
            return None
        return ks, vs, (keys[0], dummy(), dummy()), (values[0], dummy(), dummy()), dummy(mx.float32), dummy(mx.float32)
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


def paged_launches(q: mx.array, view) -> list[Launch] | None:
    """A PagedView (rows of one layer in pages (P, H', PAGE, ...) of one pool, a block table per row)
    as one launch: the kernel finds each tile's page in the table."""
    if not _rotation_ok(view.rotation, view.key_codec, view.value_codec):
        return None
    pool = view.pool
    if view.joint:
        keys, values, vh = pool, pool, view.heads
    else:
        keys, values, vh = pool[: view.n_key_parts], pool[view.n_key_parts :], 0
    sides = _sides(view.key_codec, view.value_codec, keys, values, (view.head_dim, view.value_dim),
                   view.rotation is not None)
    if sides is None:
        return None
    return [Launch(*sides, _packed_rows(view.q_start, view.n_queries), view.pages * PAGE, vh, view.table)]


def _packed_rows(q_start: mx.array, n_queries: int) -> mx.array:
    """(B, 3) bounds (-BIG, q + 1, q + N) of packed rows, made once per step (cache.packed.per_step)."""
    def make():
        qs = q_start.astype(mx.int32)
        return mx.stack([mx.full(qs.shape, -BIG, dtype=mx.int32), qs + 1, qs + n_queries], axis=1)

    return per_step("kernel rows", q_start, n_queries, make)


def plan_for(key: Side, value: Side, rep: int, n_queries: int, paged: bool, q_dtype) -> Plan:
    """The plan a launch runs: the tensor-core body (in the form `form_for` picks) where it covers the sides and
    queries, else the scalar one."""
    return _plan(key, value, rep, n_queries, paged, dtype_name(q_dtype), form_for(key, value))


@cache
def _plan(key: Side, value: Side, rep: int, n_queries: int, paged: bool, q_dtype: str, form: int) -> Plan:
    return Plan(key, value, rep, n_queries, paged, form if mma_fits(key, value, rep, n_queries, q_dtype) else 0)


def attend(q: mx.array, launches: list[Launch] | None, heads: int, scale: float, sinks) -> mx.array | None:
    """The kernel's attention for these launches, or None where a plan is not admitted. One
    launch merges its own splits; several (segments of a view) are merged by one more launch."""
    if not launches or backend_name() != "cuda":
        return None
    B, Hq, N, _ = q.shape
    if N > MAX_QUERIES or Hq % heads or q.dtype not in Q_TYPES:
        return None
    rep = Hq // heads
    plans = [plan_for(L.key, L.value, rep, N, L.table is not None, q.dtype) for L in launches]
    if any(not admitted(p, q.dtype) for p in plans) or len({p.value.dim for p in plans}) > 1:
        return None
    if not all(token_offsets_fit(p.key, p.value, L.columns, L.table is not None) for L, p in zip(launches, plans)):
        return None
    if len(launches) == 1 and fusable(plans[0], B, heads, launches[0].columns):
        return partials(q, launches[0], plans[0], scale, heads, sinks=sinks, fused=True)[3]
    parts = [partials(q, L, p, scale, heads) for L, p in zip(launches, plans)]
    return merge(q, parts, rep, plans[0].value.dim, sinks)


def view_attention(q: mx.array, view, scale: float, sinks=None) -> mx.array | None:
    """kv_attention's kernel branch for a KVView: the output, or None (the portable path serves)."""
    if backend_name() != "cuda" or q.shape[2] > MAX_QUERIES:
        return None
    if view.memo is not None and view.steady:
        return _steady(q, view, scale, sinks)
    return attend(q, view_launches(q, view), view.heads, scale, sinks)


_MISS = object()


def _steady(q: mx.array, view, scale: float, sinks) -> mx.array | None:
    """A plain compressed layer's decode step (`KVView.steady`): what depends only on the cache's
    settings (sides, codebooks, plan, its verdict, the kernel objects, each length's geometry) is
    derived once and kept in the cache's memo, so a step pays for the launch alone. The same
    launch as `attend(view_launches(...))`."""
    seg = view.segments[0]
    recipe = _kept_recipe(q, view, ("kernel", seg.rotation, sinks is not None), view_launches)
    if recipe is None:
        return None
    return _steady_launch(q, view, recipe, scale, sinks)


def _steady_launch(q: mx.array, view, recipe: tuple, scale: float, sinks) -> mx.array | None:
    """The launch of a steady view's one segment from its recipe: joint storage, or a key and a value set
    (TurboQuant, mixed codecs) read from the segment's parts; None where those are not the kernel's arrays."""
    seg = view.segments[0]
    rows = _rows((-BIG, view.q_start + 1 - seg.start, seg.length), q.shape[0])
    if seg.joint is not None:
        return joint_launch(q, recipe, seg.joint, rows, seg.length, view.heads, scale, sinks)
    ka, va = _codec_arrays(recipe[1][0], seg.keys), _codec_arrays(recipe[2][0], seg.values)
    if ka is None or va is None:
        return None
    return arrays_launch(q, recipe, ka, va, 0, rows, seg.length, view.heads, scale, sinks)


def kept_launch(q: mx.array, view, scale: float, sinks) -> mx.array | None:
    """A steady layer's launch straight from its cache's memo, where `kv_attention` leaves it once the kernel
    has served the layer (hook._sdpa tries it before dispatching): the launch `kv_attention`'s kernel branch makes,
    without the dispatch that reaches it. None where that branch would not serve this call (fewer
    tokens than `cuda_min_tokens`, a query shape or dtype with no kept recipe): the general path decides."""
    seg = view.segments[0]
    if q.shape[2] > MAX_QUERIES or (view.config or DEFAULT).cuda_min_tokens > q.shape[0] * seg.length:
        return None
    rot = view.memo.get("rotation", _MISS)  # a rotation codec's layer attends in its basis (`in_rotated_basis`)
    if rot is _MISS:
        return None
    if rot is None:
        recipe = view.memo.get(("kernel", None, sinks is not None, q.dtype, q.shape[1], q.shape[2]))
        out = None if recipe is None or recipe is _MISS else _steady_launch(q, view, recipe, scale, sinks)
    else:
        out = _rotated_launch(q, view, rot, scale, sinks)
    if out is None:
        return None
    if view.stats is not None:
        view.stats.record("cuda-kernel")
    return out


def _rotated_launch(q: mx.array, view, rot, scale: float, sinks) -> mx.array | None:
    """A rotation codec's steady step (TurboQuant): the query rotated in float32 goes to the kernel as it is (the
    tensor-core body packs its fragments from float whatever q's type) and the kernel's float32 output goes
    straight into the inverse rotation, which rounds once to q's dtype: no cast either side of the launch
    (`in_rotated_basis` rounds the rotated query to q's dtype and widens the output back: two launches a layer
    more). The recipe is kept for float32 queries over the view in the rotation's basis. With
    MLXKV_CUDA_TURBO_ROTATE=1 (`cuda_rotate`, opt-in) a Hadamard rotation runs inside the launch instead, where the
    launch merges its own splits: the query goes in as it is and the output comes out in its basis."""
    if cuda_rotate.enabled() and rot.signs is not None:
        recipe = _kept_recipe(q, view, ("kernel-rotating", rot, sinks is not None),
                              lambda qq, v: view_launches(qq, rotate_view(v, rot)), rotating=rot)
        out = None if recipe is None else _steady_launch(q, view, recipe, scale, sinks)
        if out is not None:
            return out
    qr = rot.forward(q)
    recipe = _kept_recipe(qr, view, ("kernel", rot, sinks is not None),
                          lambda qq, v: view_launches(qq, rotate_view(v, rot)))
    if recipe is None:
        return None
    out = _steady_launch(qr, view, recipe, scale, sinks)
    return None if out is None else rot.inverse(out, q.dtype)


def _kept_recipe(q: mx.array, view, name: tuple, launches, rotating=None) -> tuple | None:
    """The recipe of this view's launch for queries like `q`, kept in the cache's memo under `name`
    (made from `launches(q, view)` the first time; `rotating`: a rotation the launch applies itself)."""
    key = (*name, q.dtype, q.shape[1], q.shape[2])
    recipe = view.memo.get(key, _MISS)
    if recipe is _MISS:
        recipe = view.memo[key] = _recipe(q, launches(q, view), view.heads, rotating)
    return recipe


def _recipe(q: mx.array, launches: list[Launch] | None, heads: int, rotating=None) -> tuple | None:
    """(plan, (key side, book), (value side, book), {geometry}) of one joint launch, or None where
    the kernel does not serve it (`attend`'s checks, made once per cache). `rotating`: the plan rotates the query and
    the output itself (cuda_rotate.py), its key book followed by the rotation's signs."""
    if not launches or len(launches) != 1:
        return None
    _, Hq, N, _ = q.shape
    if Hq % heads or q.dtype not in Q_TYPES:
        return None
    L = launches[0]
    plan = plan_for(L.key, L.value, Hq // heads, N, L.table is not None, q.dtype)
    k_book = L.k_book
    if rotating is not None:
        plan = replace(plan, rotate=True)
        k_book = cuda_rotate.book_with_signs(L.k_book, rotating.signs)
    if not admitted(plan, q.dtype):
        return None
    return plan, (L.key, k_book), (L.value, L.v_book), {}


def packed_attention(q: mx.array, view, scale: float, sinks=None) -> mx.array | None:
    """packed_attention's kernel branch for a PackedView: the output, or None."""
    if backend_name() != "cuda" or q.shape[2] > MAX_QUERIES:
        return None
    coded = view.key_codec is not None and view.value_codec is not None
    if view.memo is None or (view.joint is None and not coded):  # full-precision packed rows: launches each step
        return attend(q, packed_launches(q, view), view.heads, scale, sinks)
    recipe = _kept_recipe(q, view, ("packed kernel", view.rotation, sinks is not None), packed_launches)
    if recipe is None:
        return None
    rows = _packed_rows(view.q_start, q.shape[2])
    if view.joint is not None:
        return joint_launch(q, recipe, view.joint, rows, view.capacity, view.heads, scale, sinks)
    ka, va = _codec_arrays(recipe[1][0], view.key_parts), _codec_arrays(recipe[2][0], view.value_parts)  # TurboQuant
    if ka is None or va is None:
        return None
    return arrays_launch(q, recipe, ka, va, 0, rows, view.capacity, view.heads, scale, sinks)


def paged_attention(q: mx.array, view, scale: float, sinks=None) -> mx.array | None:
    """kvcore.attention.paged's kernel branch for a PagedView: the output, or None. Joint storage
    launches from the rows' recipe (kept in their memo, as packed rows do)."""
    if backend_name() != "cuda" or q.shape[2] > MAX_QUERIES:
        return None
    if view.memo is None or not view.joint:
        return attend(q, paged_launches(q, view), view.heads, scale, sinks)
    recipe = _kept_recipe(q, view, ("paged kernel", view.rotation, sinks is not None), paged_launches)
    if recipe is None:
        return None
    return joint_launch(q, recipe, Joint(view.pool, view.heads), _packed_rows(view.q_start, q.shape[2]),
                        view.pages * PAGE, view.heads, scale, sinks, view.table)


# -- admission: each plan checked once on the device ---------------------------------------------
def admitted(plan: Plan, q_dtype) -> bool:
    key = (plan, dtype_name(q_dtype))
    if key not in _VERDICTS:
        why = plan.why_not()
        if why is not None:
            _VERDICTS[key] = why  # refused without a device check
        else:
            from .cuda_check import check_plan

            _VERDICTS.admitted(key, lambda: check_plan(plan, q_dtype), describe(*key))
    return _VERDICTS[key] is None


def status() -> dict:
    """Every plan asked for so far and its verdict (None: admitted)."""
    return {describe(p, dt): why for (p, dt), why in _VERDICTS.items()}


def applies(q: mx.array, key_codec, value_codec) -> bool:
    """Whether the kernel reads these codecs here, outside a rotated basis (CUDA only)."""
    if backend_name() != "cuda" or q.shape[2] > MAX_QUERIES:
        return False
    return all(c is not None and _codec_side(c, c.head_dim, False) is not None for c in (key_codec, value_codec))
