"""The device check that admits a kernel plan: random K/V stored as the plan says, kernel == reference.

Run once per (plan, query dtype) the first time attention asks for it, on the device (the one
host read-back is here, never in a decode step): two rows of uneven lengths, several tiles and
splits, causal queries, a lower bound (window-like) and a lag (recent-like) on the second row,
stored as slices of bigger buffers (read in place through strides), attention sinks; the
reference is float32 attention over the decoded values, computed on the CPU.
"""

from __future__ import annotations

import math

import mlx.core as mx

from ..codecs import CodecSpec
from ..codecs.affine import AffineCodec
from ..codecs.turbo import TurboCodec
from .blockwise import reference_attention
from .cuda_launch import BIG, PAGE, Plan, Side

TOLERANCE = {"float32": 1e-4, "float16": 3e-3, "bfloat16": 1.5e-2}  # |out - ref| / |ref|
HEADS = 2


def random_side(side: Side, B: int, T: int, cap: int, key) -> tuple[tuple, mx.array, mx.array]:
    """(arrays as the kernel takes them, codebook, float32 values the kernel must see): (B, HEADS, T, ...)."""
    from .cuda_kernels import dummy as _dummy

    x = mx.random.normal((B, HEADS, cap, side.dim), key=key)
    if side.kind == "affine":
        codec = AffineCodec(CodecSpec("affine", side.bits, side.group), side.dim)
        enc = codec.encode(x)
        parts, book, dec = enc, _dummy(mx.float32), codec.decode(enc, mx.float32)
    elif side.kind == "turbo":
        codec = TurboCodec(CodecSpec("turbo", side.bits), side.dim)
        enc = codec.encode(x)
        parts, book, dec = (*enc, _dummy()), codec.centroids, codec.decode_rotated(enc, mx.float32)
    else:
        a = x.astype(getattr(mx, side.dtype))
        parts, book, dec = (a, _dummy(), _dummy()), _dummy(mx.float32), a.astype(mx.float32)
    cut = tuple(p[:, :, :T] if p.ndim == 4 else p for p in parts)  # slices of a bigger buffer
    return cut, book, dec[:, :, :T]


def check_inputs(plan: Plan, q_dtype, seed: int = 0):
    """(q, launch, reference output, sinks, scale, split) for one random case of this plan."""
    from .cuda_kernels import Launch

    B, N = 2, plan.n_queries
    counts = (2 * plan.tile + 45, 37)
    T = max(counts)
    keys = mx.random.split(mx.random.key(seed), 4)
    ka, kbook, kd = random_side(plan.key, B, T, T + 19, keys[0])
    va, vbook, vd = random_side(plan.value, B, T, T + 19, keys[1])
    q = mx.random.normal((B, HEADS * plan.rep, N, plan.key.dim), key=keys[2]).astype(q_dtype)
    rot = None
    if plan.rotate:  # the launch rotates q itself (cuda_rotate.py): K/V are in the codec's basis, q and the output not
        from ..codecs import CodecSpec
        from ..codecs.turbo import TurboCodec
        from .cuda_rotate import book_with_signs

        rot = TurboCodec(CodecSpec("turbo", plan.key.bits), plan.key.dim).rotation
        kbook = book_with_signs(kbook, rot.signs)
    sinks = mx.random.normal((HEADS * plan.rep,), key=keys[3])
    bounds = [(-BIG, counts[0] - N + 1, counts[0]), (3, counts[1] - N - 1, counts[1])]
    rows = mx.array(bounds, dtype=mx.int32)
    scale = plan.key.dim ** -0.5
    with mx.stream(mx.cpu):
        j = mx.arange(T)[None, None]  # (1, 1, T)
        n = mx.arange(N)[None, :, None]  # (1, N, 1)
        lo, hi, cnt = (rows[:, i][:, None, None] for i in range(3))
        mask = ((j >= lo + n) & (j < mx.minimum(hi + n, cnt)))[:, None]  # (B, 1, N, T)
        qf = q.astype(mx.float32) if rot is None else rot.forward(q)
        ref = reference_attention(qf, kd, vd, scale, mask, sinks)
        ref = ref if rot is None else rot.inverse(ref)
        mx.eval(ref)
    if plan.paged:  # the same tokens in pages of one pool, the pages shuffled, found through a table
        ka, va, table = paged_copy(ka, va, T, keys[3])
        launch = Launch(plan.key, plan.value, ka, va, kbook, vbook, rows, table.shape[1] * PAGE, table=table)
        return q, launch, ref, sinks, scale, (plan.tile, -(-(table.shape[1] * PAGE) // plan.tile))
    launch = Launch(plan.key, plan.value, ka, va, kbook, vbook, rows, T)
    return q, launch, ref, sinks, scale, (plan.tile, -(-T // plan.tile))


def paged_copy(ka: tuple, va: tuple, T: int, key) -> tuple[tuple, tuple, mx.array]:
    """Rows' arrays (B, H, T, ...) -> the same in pages (P, H, PAGE, ...) in a shuffled order, and the
    (B, pages) table that finds them."""
    B = ka[0].shape[0]
    n = -(-T // PAGE)
    order = mx.random.permutation(B * n, key=key)  # page i of the pool holds the rows' page order[i]
    table = mx.argsort(order).astype(mx.int32).reshape(B, n)

    def pages(a):
        if a.ndim != 4:  # a dummy
            return a
        a = mx.pad(a, [(0, 0), (0, 0), (0, n * PAGE - a.shape[2]), (0, 0)])
        a = a.reshape(B, a.shape[1], n, PAGE, a.shape[3]).transpose(0, 2, 1, 3, 4).reshape(B * n, a.shape[1], PAGE, -1)
        return a[order]

    return tuple(pages(a) for a in ka), tuple(pages(a) for a in va), table


def check_plan(plan: Plan, q_dtype, seed: int = 0) -> str | None:
    """None when the kernel matches the reference for this plan on the device, else why not."""
    from .cuda_kernels import dtype_name as _dtype_name
    from .cuda_kernels import merge, partials

    q, launch, ref, sinks, scale, split = check_inputs(plan, q_dtype, seed)
    tol = TOLERANCE[_dtype_name(q_dtype)]
    if plan.mma:  # the tensor-core body multiplies fp16 fragments whatever q's type (float32: turbo's rotated query)
        tol = max(tol, TOLERANCE["float16"])
    one = partials(q, launch, plan, scale, HEADS, split, sinks=sinks, fused=True)[3]  # splits merged in the launch
    outs = [("kernel merging its splits", one)]
    if not plan.rotate:  # a rotating plan's outputs come from the launch that merges its splits alone
        outs.append(("kernel and merge", merge(q, [partials(q, launch, plan, scale, HEADS, split)], plan.rep,
                                                  plan.value.dim, sinks)))
    for name, out in outs:
        err = relative_error(out, ref)
        if not err <= tol:
            return f"{name} differs from the reference: relative error {err:.3g} > {tol}"
    return None


def relative_error(out: mx.array, ref: mx.array) -> float:
    with mx.stream(mx.cpu):
        o, r = out.astype(mx.float32), ref.astype(mx.float32)
        err = (mx.sqrt(((o - r) ** 2).sum()) / mx.maximum(mx.sqrt((r * r).sum()), 1e-30)).item()
    return err if math.isfinite(err) else float("inf")  # NaN never passes
