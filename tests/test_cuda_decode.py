"""The CUDA decode kernel on any backend: its index math (numpy emulation) == mx.dequantize and the
portable path, its launch arithmetic, and its selection (CUDA only; the portable path elsewhere and for
shapes it does not cover)."""

from __future__ import annotations

import re
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from kvcore.attention import blockwise, cuda_decode, cuda_launch, cuda_source
from kvcore.attention.config import AttentionConfig
from kvcore.attention.cuda_launch import (
    BIG,
    MAX_SMEM,
    TARGET_BLOCKS,
    Plan,
    Side,
    token_bounds,
)
from kvcore.attention.rotated import rotate_view, shared_rotation
from kvcore.backend import backend_name
from kvcore.cache import BatchCompressedKVCache, CompressedKVCache
from kvcore.codecs import CodecSpec, make_codec
from kvcore.codecs.bitpack import unpack
from kvcore.errors import MlxkvError
from tests.cuda_emulation import codes, decoded, emulate, words

PORTABLE = AttentionConfig(cuda_kernel=False, qmm=False)
PACKED = AttentionConfig(cuda_kernel=False, qmm=False, paged=False)  # batch rows as the kernel reads them


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_word_extraction_equals_mx_dequantize(bits):
    """The kernel's element formula over MLX's packing, every affine width, group and head dim."""
    mx.random.seed(bits)
    for group in (32, 64, 128):
        for dim in (64, 128, 256):
            if dim % group:
                continue
            codec = make_codec(CodecSpec("affine", bits, group), dim)
            enc = codec.encode(mx.random.normal((1, 2, 5, dim)))
            got = decoded(Side("affine", bits, group, dim), enc, None)
            assert np.array_equal(got, np.array(codec.decode(enc, mx.float32))), (group, dim)


@pytest.mark.parametrize("bits", range(1, 9))
def test_word_extraction_reads_turbo_bytes(bits):
    """TurboQuant's byte packing read as 32-bit words gives bitpack's indices and decode_rotated's values."""
    mx.random.seed(10 + bits)
    for dim in (64, 128):
        codec = make_codec(CodecSpec("turbo", bits), dim)
        packed, norm = codec.encode(mx.random.normal((1, 2, 4, dim)))
        c = codes(words(packed), dim, bits)
        assert np.array_equal(c, np.array(unpack(packed, bits, dim)))
        got = decoded(Side("turbo", bits, dim, dim), (packed, norm), codec.centroids)
        assert np.allclose(got, np.array(codec.decode_rotated((packed, norm), mx.float32)), atol=1e-6)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_word_extraction_reads_dense_rows(dtype):
    x = mx.random.normal((1, 2, 3, 64)).astype(getattr(mx, dtype))
    got = decoded(Side.dense(dtype, 64), (x,), None)
    assert np.array_equal(got, np.array(x.astype(mx.float32)))


PLANS = [Plan(Side("affine", b, g, d), Side("affine", vb, g, d), rep, n)
         for b, vb in ((4, 4), (8, 4), (3, 5), (2, 6)) for g, d in ((64, 128), (32, 64), (128, 256))
         for rep, n in ((1, 1), (4, 1), (8, 1), (4, 8), (3, 5))]
PLANS += [Plan(Side("turbo", 4, d, d), Side("turbo", 3, d, d), 4, 1) for d in (64, 128, 256)]
PLANS += [Plan(Side.dense(t, d), Side.dense(t, d), rep, 1) for t in ("bfloat16", "float32") for d in (64, 128, 256)
          for rep in (1, 4)]


@pytest.mark.parametrize("plan", PLANS, ids=cuda_decode.describe)
def test_launch_arithmetic(plan):
    assert plan.why_not() is None
    assert plan.qvb * plan.nqc == plan.qv and plan.qvb <= 8 and plan.qvp % 4 == 0
    assert plan.tpr * plan.ve == plan.value.dim and plan.ts * plan.tpr == cuda_launch.THREADS
    # shared memory: aligned regions that do not overlap, inside the budget
    lay = plan.layout
    regions = [k for k in lay if k != "TOTAL"]
    assert all(lay[k] % 16 == 0 for k in regions) and lay["TOTAL"] <= MAX_SMEM
    assert [lay[k] for k in regions] == sorted(lay[k] for k in regions)  # in order, none before another's end
    assert lay["KT"] + plan.key.tile_bytes(plan.tile) == lay["VT"]
    assert lay["VT"] + plan.value.tile_bytes(plan.tile) <= lay["TOTAL"]
    assert lay["P"] + plan.tile * plan.qvp * 4 <= lay["KT"]
    assert lay["KT"] + plan.ts * plan.qvb * plan.value.dim * 4 <= lay["TOTAL"]  # the partials' scratch
    # splits: whole tiles, cover the capacity, enough blocks, from the host int alone
    for columns in (1, 127, 128, 129, 4096, 32768, 131072):
        for rows, heads in ((1, 8), (16, 8), (3, 2)):
            chunk, nsplit = plan.splits(columns, rows, heads)
            assert chunk % plan.tile == 0 and (nsplit - 1) * chunk < columns <= nsplit * chunk
            tiles = -(-columns // plan.tile)
            assert nsplit == tiles or nsplit * rows * heads * plan.nqc >= TARGET_BLOCKS / 2
            assert plan.grid(nsplit, heads, rows) == (nsplit * plan.nqc * cuda_launch.THREADS, heads, rows)


def test_every_constant_the_source_reads_is_in_the_template():
    plan = PLANS[0]
    names = {n for n, _ in plan.template}
    used = set(re.findall(r"\b([A-Z][A-Z0-9_]{1,})\b", cuda_source.SOURCE)) - {"NEG", "QVT", "NWARP", "CHUNK", "NSPLIT", "VH", "PTW", "HQ", "D4"}
    used -= {"FUSED", "HAS_SINK", "OT"}  # per kernel object, beside the plan's (cuda_kernels._kernel)
    assert used <= names, used - names
    assert {f"OFF_{k}" for k in plan.layout if k != "TOTAL"} <= used


def test_plans_it_does_not_cover():
    assert Plan(Side.dense("float32", 512), Side.dense("float32", 512), 1, 1).why_not()
    with pytest.raises(ValueError):
        Side("affine", 3, 64, 80)  # head dim not whole groups
    with pytest.raises(ValueError):
        Plan(Side("affine", 4, 64, 64), Side("affine", 4, 64, 64), 1, 9)  # more than 8 queries


def _spec(name, bits):
    return CodecSpec(name, bits, 64 if name == "affine" else None)


def _views(cache, steps, Hkv=2, D=64, dtype=mx.float32):
    """Updates of (tokens per update) and the last view."""
    for n in steps:
        k, v = (mx.random.normal((1, Hkv, n, D)).astype(dtype) for _ in range(2))
        view, _ = cache.update_and_fetch(k, v)
    return view


CACHES = [  # key, value, start, window, keep, recent, steps (the last = queries)
    ("affine", 4, 4, 0, None, 0, 0, (300, 1)),
    ("affine", 8, 4, 16, None, 0, 0, (200, 70, 4)),
    ("affine", 3, 5, 0, None, 0, 9, (260, 1)),
    ("affine", 2, 6, 0, 96, 4, 0, (333, 3)),
    ("affine", 4, 4, 0, 200, 8, 5, (300, 1)),
    ("turbo", 4, 3, 0, None, 0, 6, (290, 2)),
    ("full", None, None, 0, None, 0, 0, (150, 1)),
]


@pytest.mark.parametrize("case", CACHES, ids=lambda c: f"{c[0]}{c[1]}-{c[2]}-w{c[4]}-r{c[6]}")
def test_token_bounds_equal_segment_visibility(case):
    name, kb, vb, start, window, keep, recent, steps = case
    mx.random.seed(1)
    cache = CompressedKVCache(_spec(name, kb), _spec(name, vb), start, window, keep, recent=recent)
    view = _views(cache, steps)
    for seg in view.segments:
        b = token_bounds(view.q_start, view.n_queries, seg.start, seg.length, window=view.window, keep=view.keep,
                         kind=seg.kind, block_tokens=seg.block_tokens, lag=seg.lag)
        assert b is not None
        lo, hi, cnt = b
        n, j = np.arange(view.n_queries)[:, None], np.arange(seg.length)[None]
        mine = (j >= lo + n) & (j < np.minimum(hi + n, cnt))
        want = np.array(seg.visible(view.q_positions, 0, seg.length, view.window, view.keep))
        assert np.array_equal(mine, want), seg.kind


@pytest.mark.parametrize("case", CACHES, ids=lambda c: f"{c[0]}{c[1]}-{c[2]}-w{c[4]}-r{c[6]}")
@pytest.mark.parametrize("rep", [1, 4])
def test_emulated_kernel_equals_portable_path(case, rep):
    """Every segment a launch, splits from the capacity, merged with sinks == kv_attention."""
    name, kb, vb, start, window, keep, recent, steps = case
    mx.random.seed(2 + rep)
    cache = CompressedKVCache(_spec(name, kb), _spec(name, vb), start, window, keep, recent=recent,
                              attention=PORTABLE)
    view = _views(cache, steps)
    q = mx.random.normal((1, 2 * rep, view.n_queries, 64))
    sinks = mx.random.normal((2 * rep,)) if rep == 4 else None
    want = blockwise.kv_attention(q, view, 0.125, sinks)
    rot = shared_rotation(view)
    qr, rv = (q, view) if rot is None else (rot.forward(q), rotate_view(view, rot))
    launches = cuda_decode.view_launches(qr, rv)
    if name == "full":  # a causal full-precision row: left to MLX's fused SDPA (no array mask)
        assert launches is None
        launches = cuda_decode.view_launches(qr, replace(rv, window=10**9))  # a window: the dense variant
    assert launches is not None and len(launches) == len([s for s in view.segments if s.length])
    got = mx.array(emulate(qr, launches, 2, 0.125, sinks))
    if rot is not None:
        got = rot.inverse(got)
    assert np.allclose(np.array(got), np.array(want), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("spec", [("affine", 4, 4), ("affine", 8, 3), ("turbo", 4, 3), ("full", None, None)])
def test_emulated_kernel_over_packed_rows_of_uneven_lengths(spec):
    name, kb, vb = spec
    mx.random.seed(5)
    rows = []
    for n in (5, 300, 130):
        c = CompressedKVCache(_spec(name, kb), _spec(name, vb), start=0, attention=PACKED)
        c.update_and_fetch(mx.random.normal((1, 2, n, 64)), mx.random.normal((1, 2, n, 64)))
        rows.append(c)
    batch = BatchCompressedKVCache(rows)
    for N in (1, 3):
        pv, launches = _emulated_batch_step(batch, N, cuda_decode.packed_launches)
        assert launches[0].columns == pv.key_parts[0].shape[2]  # the capacity


def _emulated_batch_step(batch, N: int, make_launches):
    """One N-token step of a 3-row batch: the emulated launches `make_launches` builds (in the view's
    rotated basis where it has one) == the portable attention; returns the view and the launches."""
    pv, _ = batch.update_and_fetch(mx.random.normal((3, 2, N, 64)), mx.random.normal((3, 2, N, 64)))
    q = mx.random.normal((3, 8, N, 64))
    want = blockwise.packed_attention(q, pv, 0.125, None)
    rot = shared_rotation(pv)
    qr, rv = (q, pv) if rot is None else (rot.forward(q), rotate_view(pv, rot))
    launches = make_launches(qr, rv)
    assert launches is not None
    got = mx.array(emulate(qr, launches, 2, 0.125))
    got = got if rot is None else rot.inverse(got)
    assert np.allclose(np.array(got), np.array(want), atol=2e-5, rtol=1e-4), N
    return pv, launches


def test_selection_falls_back_off_cuda_and_for_uncovered_layouts():
    mx.random.seed(6)
    cache = CompressedKVCache(_spec("affine", 4), start=0, attention=AttentionConfig(cuda_kernel=True, cuda_min_tokens=0))
    view = _views(cache, (100, 1))
    q = mx.random.normal((1, 4, 1, 64))
    on_cuda = backend_name() == "cuda"
    assert (cuda_decode.view_attention(q, view, 0.125) is not None) is on_cuda  # the kernel serves on CUDA only
    out = blockwise.kv_attention(q, view, 0.125)
    assert ("cuda-kernel" in cache.stats.calls) is on_cuda
    tol = {"atol": 2e-5, "rtol": 1e-4} if on_cuda else {"atol": 1e-5}  # the kernel: cuda_check's float32 tolerance
    assert mx.allclose(out, blockwise.kv_attention(q, view, 0.125, config=PORTABLE), **tol).item()
    # layouts no launch covers, whatever the backend: token-grouped affine (head dim 8), turbo outside
    # the rotated basis, and more than 8 queries
    tok = CompressedKVCache(CodecSpec("affine", 4, 32), start=0)
    tv = _views(tok, (64, 1), D=8)
    assert cuda_decode.view_launches(mx.zeros((1, 2, 1, 8)), tv) is None
    turbo = CompressedKVCache(CodecSpec("turbo", 4), start=0)
    assert cuda_decode.view_launches(q, _views(turbo, (50, 1))) is None  # not rotated: would need R^T per token
    assert cuda_decode.applies(q, cache.key_codec, cache.value_codec) is on_cuda


def test_a_plan_outside_the_kernel_is_refused_without_a_device_check():
    plan = Plan(Side.dense("float32", 512), Side.dense("float32", 512), 1, 1)
    assert not cuda_decode.admitted(plan, mx.float32)
    assert "head dims" in cuda_decode.status()[cuda_decode.describe(plan, "float32")]


def test_check_inputs_reference_is_the_portable_attention():
    """The device check's reference (float32 over decoded values, bounds as masks) matches the emulation."""
    from kvcore.attention.cuda_check import check_inputs

    for plan in (Plan(Side("affine", 5, 64, 64), Side("affine", 3, 64, 64), 2, 3),
                 Plan(Side("turbo", 4, 64, 64), Side("turbo", 2, 64, 64), 4, 1)):
        q, launch, ref, sinks, scale, _ = check_inputs(plan, mx.float32)
        assert int(np.array(launch.rows)[1, 0]) == 3 and int(np.array(launch.rows)[0, 0]) == -BIG
        got = emulate(q, [launch], 2, scale, sinks)
        assert np.allclose(got, np.array(ref), atol=2e-5, rtol=1e-4)


def test_kernel_default_follows_the_backend_and_the_environment(monkeypatch):
    monkeypatch.delenv("MLXKV_CUDA_DECODE", raising=False)
    assert AttentionConfig().cuda_kernel is (backend_name() == "cuda")  # on where the backend is CUDA
    for value, want in (("1", True), ("0", False)):
        monkeypatch.setenv("MLXKV_CUDA_DECODE", value)
        assert AttentionConfig().cuda_kernel is want
    assert AttentionConfig().cuda_min_tokens == 8192
    with pytest.raises(MlxkvError, match="cuda_min_tokens"):
        AttentionConfig(cuda_min_tokens=-1)


@pytest.mark.parametrize("spec", [("affine", 4, 4), ("affine", 8, 3), ("turbo", 4, 3), ("full", None, None)])
def test_emulated_kernel_over_paged_rows(spec):
    """Paged rows (shuffled pages after a leave and a join, uneven lengths, 1 and 3 queries): the launch
    reads each tile's page through the block table and equals the portable attention."""
    name, kb, vb = spec
    mx.random.seed(9)
    paged = AttentionConfig(cuda_kernel=False, qmm=False, paged=True)

    def row(n):
        c = CompressedKVCache(_spec(name, kb), _spec(name, vb), start=0, attention=paged)
        c.update_and_fetch(mx.random.normal((1, 2, n, 64)), mx.random.normal((1, 2, n, 64)))
        return c

    batch = BatchCompressedKVCache([row(n) for n in (5, 300, 130)])
    batch.update_and_fetch(mx.random.normal((3, 2, 1, 64)), mx.random.normal((3, 2, 1, 64)))
    batch.filter([0, 2])
    batch.extend(BatchCompressedKVCache([row(260)]))
    for N in (1, 3):
        pv, launches = _emulated_batch_step(batch, N, cuda_decode.paged_launches)
        assert launches[0].table is not None and launches[0].columns == pv.pages * 128


def test_the_device_check_of_a_paged_plan_is_the_portable_attention():
    """A paged plan's check: the same random tokens in shuffled pages, and a lower bound off a tile edge
    on the second row (the kernel starts tiles on tile edges there and masks the rest)."""
    from kvcore.attention.cuda_check import check_inputs

    plan = Plan(Side("affine", 4, 32, 64), Side("affine", 8, 64, 64), 2, 2, paged=True)
    q, launch, ref, sinks, scale, split = check_inputs(plan, mx.float32)
    assert launch.table is not None and launch.k_arrays[0].shape[2] == 128
    got = emulate_merge_split(q, launch, plan, scale, sinks, split)
    assert np.allclose(got, np.array(ref), atol=2e-5, rtol=1e-4)


def emulate_merge_split(q, launch, plan, scale, sinks, split):
    from tests.cuda_emulation import emulate_merge, emulate_partials

    return emulate_merge([emulate_partials(q, launch, plan, scale, 2, split)], q.shape, plan.rep, sinks)


def test_release_arrival_replaces_the_fenced_one_whole():
    """The release arrival (the default since run 11) swaps the split counter's fenced arrival text
    (MLXKV_CUDA_ARRIVE=fence) for CUTLASS's semaphore pattern: the replacement must find the fenced text (a
    silent no-op would run the old arrival as the new one)."""
    default, start = cuda_source.tail("fence"), cuda_source.prologue("fence")
    assert cuda_source.FENCE_ARRIVAL in default and "slot0" not in start
    text = cuda_source.tail("release")
    assert "__threadfence" not in text and text.count("fence.acq_rel.gpu") == 2 and "slot[0]" not in text
    assert text.replace(cuda_source.RELEASE_ARRIVAL, cuda_source.FENCE_ARRIVAL) == default
    assert cuda_source.prologue("release").endswith(cuda_source.PROLOGUE_SLOT)


def test_paged_bodies_look_a_tile_s_page_up_once_one_tile_ahead():
    """Forms 1 and 3 read the block table twice in their text (before the loop, and one tile ahead inside it),
    not once per load; every load of a tile reads the tile's page (`pbt`)."""
    from kvcore.attention import cuda_form3, cuda_mma

    for body in (cuda_mma.BODY, cuda_form3.BODY):
        assert body.count("ptab[") == 2 and "PAGE_AHEAD" not in body and "TILE_PAGE" not in body
        loop = body[body.index("for (int t0 = t_begin"):]
        assert loop.index("pb_next = ptab[") < loop.index("load_words") and loop.count("const int pb = pbt") >= 2


def test_rows_past_the_32_bit_offsets_take_the_portable_path():
    """The tensor-core bodies index within a row (or page) in 32-bit ints (a token's bytes times its index, from a
    64-bit row base): a 4-bit 128-dim row (64 bytes a token) fits up to 2**25 - 1 tokens, a 256-dim 8-bit one
    (256 bytes) a quarter of that; past it `attend` and the steady launch route to the portable path. Every
    tensor-core body's loop keeps its per-token products out of 64-bit arithmetic."""
    from kvcore.attention import cuda_form3, cuda_kernels, cuda_mma, cuda_turbo_mma

    k4, k8 = Side("affine", 4, 64, 128), Side("affine", 8, 64, 256)
    assert cuda_kernels.token_offsets_fit(k4, k4, 2**25 - 1) and not cuda_kernels.token_offsets_fit(k4, k4, 2**25)
    assert cuda_kernels.token_offsets_fit(k4, k8, 2**23 - 1) and not cuda_kernels.token_offsets_fit(k4, k8, 2**23)
    assert cuda_kernels.token_offsets_fit(k4, k8, 2**30, paged=True)  # paged rows: offsets within a page
    plan = Plan(k4, k4, 4, 1, False, 3)
    recipe, q = (plan, (k4, None), (k4, None), {}), mx.zeros((1, 32, 1, 128), dtype=mx.bfloat16)
    arrays = (mx.zeros((1, 8, 1, 16), dtype=mx.uint32),) * 3
    assert cuda_kernels.arrays_launch(q, recipe, arrays, arrays, 0, None, 2**25, 8, 0.1, None) is None  # portable
    assert recipe[3] == {}  # and no geometry kept for it
    for body in (cuda_mma.BODY, cuda_form3.BODY, cuda_turbo_mma.body(128)):
        loop = body[body.index("for (int t0 = t_begin"):]
        assert "(long long)tp" not in loop and "long long ktb" not in body and "static_cast<int>(ks_strides[2])" in loop


def test_a_floor_on_tiles_per_split_caps_the_splits_not_the_coverage():
    """MLXKV_CUDA_SPLIT_TILES's floor (the A/B knob): at 32k on 8 heads, 16 tiles a split give 32 splits, not the
    66 that 528 target blocks ask for; at 128k the target still decides; short rows keep a block per SM's worth
    of splits (512 tokens: 8 one-tile splits, as without the floor)."""
    plan = Plan(Side("affine", 4, 64, 128), Side("affine", 4, 64, 128), 4, 1, False, 1)  # the tensor-core body: 64-token tiles
    assert plan.splits(32768, 1, 8, split_tiles=1) == (8 * plan.tile, 64)
    assert plan.splits(32768, 1, 8, split_tiles=16) == (16 * plan.tile, 32)
    assert plan.splits(131072, 1, 8, split_tiles=16) == plan.splits(131072, 1, 8, split_tiles=1)
    assert plan.splits(512, 1, 8, split_tiles=16) == plan.splits(512, 1, 8, split_tiles=1) == (plan.tile, 8)
    assert plan.splits(8192, 16, 8, split_tiles=16) == plan.splits(8192, 16, 8, split_tiles=1)  # 16 rows: the target
    assert plan.splits(4096, 1, 8, split_tiles=16) == (4 * plan.tile, 16)  # 64 tiles: 16 splits, 128 blocks
    for columns in (1, 129, 5000, 70000):
        chunk, nsplit = plan.splits(columns, 2, 8, split_tiles=16)
        assert chunk % plan.tile == 0 and (nsplit - 1) * chunk < columns <= nsplit * chunk


def test_splits_rounded_down_stay_within_one_wave():
    """Splits rounded down (the default since run 11; MLXKV_CUDA_SPLIT_ROUND=up the A/B knob): 16 rows x 8 heads take 4 splits (512 blocks of 528), not the 5
    (640 blocks) rounding up gives; a single row of 8 heads divides the target and is unchanged."""
    plan = Plan(Side("affine", 4, 64, 128), Side("affine", 4, 64, 128), 4, 1, False, 1)
    assert plan.splits(8192, 16, 8, round_="up")[1] == 5 and plan.splits(8192, 16, 8, round_="down")[1] == 4
    for columns, rows in ((32768, 1), (131072, 1), (512, 1), (8192, 3), (4096, 7)):
        down = plan.splits(columns, rows, 8, round_="down")
        assert down[1] * rows * 8 * plan.nqc <= TARGET_BLOCKS or down[1] == 1
        assert (down[1] - 1) * down[0] < columns <= down[1] * down[0]
    assert plan.splits(32768, 1, 8, round_="down") == plan.splits(32768, 1, 8, round_="up")



def test_kernel_names_follow_their_text():
    """MLX names a kernel's compiled module (in memory and in its PTX cache on disk, shared by processes) after
    the kernel's name alone: each text gets its own name, so an A/B variant or another plan in a later process
    never runs a module compiled from another text; the same text keeps its name (the disk cache serves)."""
    fenced = cuda_source.prologue("fence") + cuda_source.SCALAR_BODY + cuda_source.tail("fence")
    released = cuda_source.prologue("release") + cuda_source.SCALAR_BODY + cuda_source.tail("release")
    a, b = cuda_source.kernel_name("mlxkv_decode", fenced), cuda_source.kernel_name("mlxkv_decode", released)
    assert a != b and a == cuda_source.kernel_name("mlxkv_decode", fenced) and a.isidentifier()
    assert cuda_source.kernel_name("k", "ab", "c") != cuda_source.kernel_name("k", "a", "bc")  # texts kept apart
