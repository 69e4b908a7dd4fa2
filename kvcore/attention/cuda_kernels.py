"""The decode kernel's objects and launches (`mx.fast.cuda_kernel`): one kernel object per plan, its
constants in its source; the ring of split counters that fused launches merge with; a launch's
geometry, inputs and outputs; the merge launch. `cuda_decode.py` decides what to launch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import mlx.core as mx

from ..backend import paged
from . import (cuda_carry, cuda_chunk_mma, cuda_form3, cuda_lean, cuda_mma, cuda_prefetch, cuda_ring, cuda_rotate,
               cuda_scaled, cuda_stage, cuda_turbo3, cuda_turbo_mma)
from .cuda_source import rewrite
from . import cuda_source as src
from .cuda_launch import PAGE, THREADS, Plan, Side

_KERNELS: dict = {}
_CONST: dict = {}
Q_TYPES = (mx.bfloat16, mx.float16, mx.float32)


@cache
def dtype_name(dtype) -> str:
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
    table: mx.array | None = None  # paged: (B, width) int32 block table; the arrays are pages (P, H', PAGE, ...)


def _const(key, make):
    if key not in _CONST:
        _CONST[key] = make()
    return _CONST[key]


def dummy(dtype=mx.float16) -> mx.array:
    return _const(("dummy", dtype), lambda: mx.zeros((1,), dtype=dtype))


# The constants a launch reads (dims, scale, the counters' slot) are never MLX's pool scalars (backend.paged
# says why: run 14's ncu had 44% of a 4k launch's stall samples on the first read of the 4-byte `fscale`), but
# pages of their own, written once by the host and never again: one a distinct dims tuple, ~300 in a 128k decode
# (1 MB; run 15 measured the fix with 64 KiB arrays, run 16 times the 4 KiB pages at 4k: gpu_session_kernel.sh).
def _ints(*xs: int) -> mx.array:
    return _const(("ints", xs), lambda: paged(xs, mx.int32))


def _slot(i: int) -> mx.array:
    """The counters' base of ring slot `i` as the kernel reads it (slot[0]): a view into one paged table
    of every slot's base, 4 words long so that a copy of it would still be no pool scalar."""
    table = _const(("slots",), lambda: paged(tuple(j * SLOT for j in range(RING_SLOTS + 4)), mx.int32))
    return _const(("slot", i), lambda: table[i:i + 4])


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
    special = _special(plan)  # opt-in bodies are read from the environment: a kernel per body
    key = ("decode", plan, fused, has_sink, out_dtype, special)
    k = _KERNELS.get(key)
    if k is None:
        consts = [*plan.template, ("FUSED", fused), ("HAS_SINK", has_sink), ("OT", _CTYPES[dtype_name(out_dtype)])]
        blocks = cuda_mma.min_blocks(plan.value.dim)
        text = _source_constants(consts) + body(int(plan.mma), *special)
        head = header(bool(plan.mma), cuda_prefetch.min_blocks(blocks) if special[0] == "prefetch" else blocks, special[0])
        k = _KERNELS[key] = mx.fast.cuda_kernel(
            name=src.kernel_name("mlxkv_decode", text, head), input_names=src.INPUTS, output_names=src.OUTPUTS,
            source=text, header=head, ensure_row_contiguous=False, shared_memory=plan.smem)
    return k


def _special(plan: Plan) -> tuple[str, int, int]:
    """(kind, key dim, value dim) of a tensor-core plan with a text of its own: "turbo" (cuda_turbo_mma.py) or
    "turbo3" (cuda_turbo3.py), "chunk" (affine codes that do not pair within half-words, cuda_chunk_mma.py), the
    opt-in variants ("prefetch", "scaled", "ring", "ringscaled") and form 3's ("form3", lean or not); else ("", 0, 0)."""
    if plan.mma and plan.key.kind == "turbo":  # form 3 (cuda_turbo3.py, opt-in): key dim 1 for its lean loop
        if int(plan.mma) == 3:
            return "turbo3", int(cuda_lean.enabled()), plan.value.dim
        return "turbo", plan.key.dim, plan.value.dim
    if plan.mma and plan.key.kind == "affine" and not cuda_mma.word_fits(plan.key, plan.value):
        return "chunk", plan.key.dim, plan.value.dim
    if int(plan.mma) == 1 and cuda_prefetch.enabled():  # the word body with its loads a tile ahead (opt-in)
        lvl = cuda_prefetch.level()
        return "prefetch", lvl, cuda_prefetch.distance() if lvl == 3 else 0
    lean = cuda_lean.level()  # form 3's loop without its per-tile overheads (the default; 2: carried pointers)
    if int(plan.mma) == 3 and cuda_scaled.enabled():  # form 3 on scaled codes (opt-in)
        return "scaled", lean, 0
    if int(plan.mma) == 3:
        return "form3", lean, 0
    if int(plan.mma) == 4:  # form 3's lean loop through form 2's ring (opt-in); key dim: MLXKV_CUDA_RING=only,
        return "ringscaled" if cuda_scaled.enabled() else "ring", int(cuda_ring.only()), 0  # on scaled codes
    return "", 0, 0


@cache
def body(mma: int, special: str = "", key_dim: int = 0, value_dim: int = 0) -> str:
    """The decode kernel's text after its constants: the tensor-core body (form 1, 2: staged, or 3: form 2's
    keys-as-A arithmetic with form 1's loads; form 1 over turbo rows or affine code chunks, `special`) or the
    scalar one, then the merge tail."""
    bodies = {0: src.SCALAR_BODY, 1: cuda_mma.BODY, 2: cuda_stage.BODY, 3: cuda_form3.BODY}
    if special == "turbo":
        main = cuda_turbo_mma.body(value_dim)
    elif special == "turbo3":
        main = cuda_turbo3.body(value_dim, bool(key_dim))
    elif special == "chunk":
        main = cuda_chunk_mma.body(key_dim, value_dim)
    elif special in ("scaled", "form3"):  # key_dim: 1 for the lean loop (cuda_lean.py), 2 with carried pointers
        main = cuda_scaled.body() if special == "scaled" else cuda_form3.BODY
        main = cuda_lean.lean(main) if key_dim else main
        main = cuda_carry.carry(main) if key_dim == 2 else main
    elif special in ("ring", "ringscaled"):
        main = cuda_ring.body(bool(key_dim), special == "ringscaled")
    elif special == "prefetch":  # key_dim: the level (1 keys, 2 keys and values, 3 L2); value_dim: L2's distance
        main = cuda_mma.PRELUDE + cuda_mma.QUERIES + cuda_prefetch.loop(key_dim, value_dim or 1) + cuda_mma.MERGE
    else:
        main = bodies[int(mma)]
    if special in ("turbo", "turbo3"):  # a turbo plan's ROT: the query rotation and its inverse in the launch
        return src.compact(src.prologue() + rewrite(main, [(cuda_mma.QUERIES, cuda_rotate.queries())], "cuda_kernels")
                           + cuda_rotate.tail(src.tail()))
    return src.compact(src.prologue() + main + src.tail())


@cache
def header(mma: bool, blocks: int = cuda_mma.MIN_BLOCKS, special: str = "") -> str:
    """The device functions; for the tensor-core bodies, then the kernel's launch bounds (`blocks` per SM)."""
    if not mma:
        return src.compact(src.HEADER)
    extra = {"turbo": cuda_turbo_mma.HEADER, "turbo3": cuda_turbo_mma.HEADER, "chunk": cuda_turbo_mma.HEADER + cuda_chunk_mma.HEADER,
             "scaled": cuda_scaled.HEADER, "ring": cuda_ring.HEADER,
             "ringscaled": cuda_ring.HEADER + cuda_scaled.HEADER}.get(special, "")
    return src.compact(src.HEADER + cuda_mma.HEADER + cuda_stage.HEADER + extra + cuda_mma.BOUNDS.format(blocks=blocks))


def _merge_kernel():
    k = _KERNELS.get("merge")
    if k is None:
        text = src.compact(src.MERGE_SOURCE)
        k = _KERNELS["merge"] = mx.fast.cuda_kernel(
            name=src.kernel_name("mlxkv_merge", text), input_names=src.MERGE_INPUTS, output_names=src.MERGE_OUTPUTS,
            source=text, ensure_row_contiguous=True)
    return k


# the split counters of fused launches: a ring of slots, each launch takes the next one, so
# launches that may run at once (no data dependency between them) never share a counter
RING_SLOTS = 1024
SLOT = 1024  # counters per slot: rows x KV heads x query chunks of one launch, at most
_RING = {"next": 0}


def _counters() -> mx.array:
    return _const(("ctr",), lambda: mx.zeros((RING_SLOTS * SLOT,), dtype=mx.int32))


def _next_slot() -> int:
    """The ring slot a fused launch takes (`_slot` makes its base)."""
    i = _RING["next"]
    _RING["next"] = (i + 1) % RING_SLOTS
    return i


@cache
def _geometry(plan: Plan, B: int, heads: int, columns_tiles: int) -> tuple:
    """(chunk, nsplit, grid, partial shapes) of one launch (cached: a step repeats them per layer)."""
    chunk, nsplit = plan.splits(columns_tiles * plan.tile, B, heads)
    return chunk, nsplit, plan.grid(nsplit, heads, B), plan.partial_shapes(B, heads, nsplit)


def _sinks(sinks: mx.array | None) -> mx.array:
    """The sinks' logits as the kernels read them: float32 (Hq,), a dummy when there are none."""
    return dummy(mx.float32) if sinks is None else sinks.astype(mx.float32).reshape(-1)


def _scale(scale: float) -> mx.array:
    return _const(("scale", scale), lambda: paged((scale,), mx.float32))


def partials(q: mx.array, launch: Launch, plan: Plan, scale: float, heads: int, split: tuple[int, int] | None = None,
             sinks: mx.array | None = None, fused: bool = False, kernel=None):
    """One launch: (m, l, acc) partial softmax per split, shapes from `Plan.partial_shapes`, and
    with `fused` the merged output (B, Hq, N, Dv) in q's dtype as a fourth array. `kernel`: another
    build of the plan's text to launch the same way (scripts/gpu_kernel_ablate.py), else the plan's own."""
    B, Hq, N, _ = q.shape
    if split is None:
        chunk, nsplit, grid, shapes = _geometry(plan, B, heads, -(-launch.columns // plan.tile))
    else:
        (chunk, nsplit), grid, shapes = split, plan.grid(split[1], heads, B), plan.partial_shapes(B, heads, split[1])
    slot = _next_slot() if fused else 0
    sk = _sinks(sinks)
    return (kernel or _kernel(plan, fused, sinks is not None, q.dtype))(
        inputs=[q, *launch.k_arrays, *launch.v_arrays, launch.k_book, launch.v_book, launch.rows,
                _ints(chunk, nsplit, launch.v_head, table_width(launch)), _scale(scale),
                _counters() if fused else dummy(mx.int32), _slot(slot), sk,
                dummy(mx.int32) if launch.table is None else launch.table],
        grid=grid, threadgroup=(THREADS, 1, 1),
        output_shapes=[*shapes, (B, Hq, N, plan.value.dim) if fused else (1,)],
        output_dtypes=[mx.float32] * 3 + [q.dtype],
    )


def table_width(launch: Launch) -> int:
    return 0 if launch.table is None else launch.table.shape[1]


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


ROW_OFFSET_LIMIT = 2**31  # the tensor-core bodies' offsets within a row (or page) are 32-bit ints (bytes)


def token_offsets_fit(key: Side, value: Side, columns: int, paged: bool = False) -> bool:
    """Whether a row of `columns` tokens keeps every in-row offset of the kernel below 2 GiB (a 4-bit 128-dim
    row: 33 M tokens); longer rows take the portable path. Paged rows' offsets lie within a page."""
    return (PAGE if paged else columns) * 4 * max(key.words, value.words, 1) < ROW_OFFSET_LIMIT


def fusable(plan: Plan, B: int, heads: int, columns: int) -> bool:
    """Whether one launch merges its own splits (its counters fit a slot of the ring, the split
    weights its shared memory)."""
    nsplit = _geometry(plan, B, heads, -(-columns // plan.tile))[1]
    return B * heads * plan.nqc <= SLOT and plan.merges_in_launch(nsplit)


def joint_launch(q: mx.array, recipe: tuple, joint, rows: mx.array, columns: int, heads: int, scale: float,
                 sinks, table: mx.array | None = None) -> mx.array:
    """The launch `attend` makes for one joint Launch(rows, columns[, table]), from its recipe."""
    return arrays_launch(q, recipe, joint.arrays, joint.arrays, joint.heads, rows, columns, heads, scale, sinks, table)


def arrays_launch(q: mx.array, recipe: tuple, k_arrays: tuple, v_arrays: tuple, v_head: int, rows: mx.array,
                  columns: int, heads: int, scale: float, sinks, table: mx.array | None = None) -> mx.array:
    """The launch `attend` makes for one Launch(k_arrays, v_arrays, rows, columns, v_head[, table]) from its
    recipe: joint storage (the same arrays, V from head `v_head`) or a key and a value set (v_head 0); None for
    rows too long for the kernel's 32-bit in-row offsets (checked once per geometry: the portable path serves)."""
    B = q.shape[0]
    plan, (ks, kb), (vs, vb), geometry = recipe
    tiles = -(-columns // plan.tile)
    width = 0 if table is None else table.shape[1]
    geo = geometry.get((B, tiles, width, v_head))
    if geo is None:
        if not token_offsets_fit(plan.key, plan.value, columns, table is not None):
            return None
        geo = geometry[(B, tiles, width, v_head)] = _joint_geometry(plan, B, heads, tiles, sinks is not None, q.dtype,
                                                                   width, v_head)
    kernel, grid, shapes, ints, fused = geo
    if not fused:
        if plan.rotate:  # the merge launch does not rotate back: the caller's rotations serve (cuda_rotate.py)
            return None
        launch = Launch(ks, vs, k_arrays, v_arrays, kb, vb, rows, columns, v_head, table)
        return merge(q, [partials(q, launch, plan, scale, heads)], plan.rep, plan.value.dim, sinks)
    return kernel(inputs=[q, *k_arrays, *v_arrays, kb, vb, rows, ints, _scale(scale), _counters(),
                          _slot(_next_slot()), _sinks(sinks), dummy(mx.int32) if table is None else table],
                  grid=grid, threadgroup=(THREADS, 1, 1), output_shapes=shapes, output_dtypes=_FUSED_DTYPES[q.dtype])[3]


_FUSED_DTYPES = {dt: [mx.float32] * 3 + [dt] for dt in Q_TYPES}


def _joint_geometry(plan: Plan, B: int, heads: int, tiles: int, has_sink: bool, q_dtype, width: int = 0,
                    v_head: int | None = None) -> tuple:
    """(kernel, grid, output shapes, (chunk, nsplit, v_head) array, fused) of a launch over `tiles` tiles,
    as `partials(..., fused=True)` makes them (joint V starts at head `heads`, the default `v_head`)."""
    chunk, nsplit, grid, shapes = _geometry(plan, B, heads, tiles)
    fused = B * heads * plan.nqc <= SLOT and plan.merges_in_launch(nsplit)
    out = (B, heads * plan.rep, plan.n_queries, plan.value.dim)
    vh = heads if v_head is None else v_head
    return _kernel(plan, True, has_sink, q_dtype), grid, [*shapes, out], _ints(chunk, nsplit, vh, width), fused
