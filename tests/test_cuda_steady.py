"""The decode kernel's per-cache recipes (kvcore/attention/cuda_decode.py `_steady`, packed rows):
the launch a step makes from what the cache's memo keeps is the launch the general path derives
each time, on any backend: the kernel objects are replaced by the numpy emulation of the kernel
(tests/cuda_emulation.py), which reads the launch's inputs as the kernel does, and the output is
compared with the portable attention and with the general path's launch."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvcore.attention import blockwise, cuda_decode, cuda_kernels
from kvcore.attention.config import AttentionConfig
from kvcore.attention.cuda_kernels import Launch
from kvcore.attention.hook import _sdpa
from kvcore.attention.rotated import in_rotated_basis
from kvcore.backend import PAGE_BYTES, POOL_BYTES, backend_name
from kvcore.cache import BatchCompressedKVCache, CompressedKVCache
from kvcore.codecs import CodecSpec
from tests.cuda_emulation import emulate_merge, emulate_partials

KERNEL = AttentionConfig(cuda_kernel=True, cuda_min_tokens=0, paged=False)  # the kernel reads packed rows
PORTABLE = AttentionConfig(cuda_kernel=False, qmm=False)


LAUNCHES: list = []  # (fused, grid, output shapes) of every emulated decode launch
QUERY_TYPES: list = []  # the query dtype of every emulated decode launch


class _EmulatedDecode:
    """A decode kernel object of one plan: its call emulates the launch from its inputs."""

    def __init__(self, plan, fused: bool, has_sink: bool):
        self.plan, self.fused, self.has_sink = plan, fused, has_sink
        self.calls = 0

    def __call__(self, *, inputs, grid, threadgroup, output_shapes, output_dtypes, **_):
        q, kw, ks, kb, vw, vs, vb, kbook, vbook, rows, ints, scale, _ctr, base, sinks, table = inputs
        # the constants a launch reads are never pool scalars (backend.paged): a page fault a launch
        assert ints.nbytes == scale.nbytes == PAGE_BYTES and base.nbytes > POOL_BYTES
        taken = (cuda_kernels._RING["next"] - 1) % cuda_kernels.RING_SLOTS if self.fused else 0
        assert base[0].item() == taken * cuda_kernels.SLOT  # the view reads the slot the launch took
        chunk, nsplit, v_head, width = np.array(ints[:4]).tolist()
        assert (width > 0) == self.plan.paged and (not width or tuple(table.shape) == (q.shape[0], width))
        launch = Launch(self.plan.key, self.plan.value, (kw, ks, kb), (vw, vs, vb), kbook, vbook, rows, 0, v_head,
                        table if width else None)
        parts = emulate_partials(q, launch, self.plan, float(scale[0].item()), grid[1], split=(chunk, nsplit))
        out = [mx.array(p) for p in parts]
        assert [tuple(a.shape) for a in out] == [tuple(s) for s in output_shapes[:3]]
        if self.fused:
            merged = emulate_merge([parts], q.shape, self.plan.rep, sinks if self.has_sink else None)
            out.append(mx.array(merged.astype(np.float32)).astype(output_dtypes[3]))
        else:
            out.append(mx.zeros((1,), dtype=output_dtypes[3]))
        LAUNCHES.append((self.fused, grid, [tuple(s) for s in output_shapes]))
        QUERY_TYPES.append(q.dtype)
        return out


class _EmulatedMerge:
    def __call__(self, *, inputs, template, output_shapes, output_dtypes, **_):
        m, l, acc, sinks, _ints = inputs
        t = dict(template)
        B, Hq, N, _ = output_shapes[0]
        got = emulate_merge([(np.array(m), np.array(l), np.array(acc))], (B, Hq, N, 0), t["REP"],
                            sinks if t["HAS_SINK"] else None)
        return [mx.array(got.astype(np.float32)).astype(output_dtypes[0])]


@pytest.fixture
def emulated(monkeypatch):
    """The kernel 'on CUDA', its plans admitted, its launches emulated."""
    LAUNCHES.clear()
    QUERY_TYPES.clear()
    # launch constants of this test alone: the ring's slot table is built from SLOT on first use, and a test that
    # sets SLOT to 0 (split-merge) would otherwise leave every later test's slots at base 0 (run 18/19 on CUDA,
    # where xdist happened to run one first in a worker)
    monkeypatch.setattr(cuda_kernels, "_CONST", {})
    monkeypatch.setattr(cuda_decode, "backend_name", lambda: "cuda")
    monkeypatch.setattr(cuda_decode, "admitted", lambda plan, q_dtype: True)
    monkeypatch.setattr(cuda_kernels, "_kernel", lambda plan, fused, has_sink, dt: _EmulatedDecode(plan, fused, has_sink))
    monkeypatch.setattr(cuda_kernels, "_merge_kernel", lambda: _EmulatedMerge())
    return LAUNCHES


def _close(a, b):
    return np.allclose(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("bits,rep,sinks", [(4, 4, True), (8, 1, False), (3, 2, True)])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "split-merge"])
def test_a_steady_decode_launch_is_the_general_launch(emulated, monkeypatch, bits, rep, sinks, fused):
    """Decode steps over a plain compressed layer (joint affine storage): each step's launch comes
    from the cache's memo (from the second step on, straight from hook._sdpa) and equals the portable
    attention and the general path's launch."""
    if not fused:
        monkeypatch.setattr(cuda_kernels, "SLOT", 0)  # no launch merges its own splits: a merge launch follows
    mx.random.seed(bits + rep)
    cache = CompressedKVCache(CodecSpec("affine", bits, 32), start=0, attention=KERNEL)
    cache.update_and_fetch(mx.random.normal((1, 2, 200, 64)), mx.random.normal((1, 2, 200, 64)))
    sk = mx.random.normal((2 * rep,)) if sinks else None
    for step in range(3):
        view, _ = cache.update_and_fetch(mx.random.normal((1, 2, 1, 64)), mx.random.normal((1, 2, 1, 64)))
        assert view.steady and view.segments[0].joint is not None
        assert view.launch is (cuda_decode.kept_launch if step else None)  # kept once the first step served
        q = mx.random.normal((1, 2 * rep, 1, 64))
        got = _sdpa(q, view, view, cache, 0.125, None, sinks=sk)
        general = cuda_decode.attend(q, cuda_decode.view_launches(q, view), view.heads, 0.125, sk)
        want = blockwise.kv_attention(q, view, 0.125, sk, config=PORTABLE)
        assert _close(got, want), step
        assert np.array_equal(np.array(got), np.array(general)), step
    assert any(k[0] == "kernel" for k in cache.memo if isinstance(k, tuple))  # the recipe was kept
    assert cache.stats.calls.get("cuda-kernel") == 3
    assert {f for f, _, _ in emulated} == {fused}


@pytest.mark.parametrize("kbits,vbits,sinks,dtype", [(4, 3, True, mx.float32), (4, 4, False, mx.float32),
                                                     (4, 3, True, mx.bfloat16)])
def test_a_steady_turbo_launch_is_the_general_launch(emulated, kbits, vbits, sinks, dtype):
    """TurboQuant layers (a key and a value set, not joint storage; attended in the rotated basis): from the second
    step each launch comes straight from hook._sdpa with the cache's recipe, the query rotated and the output
    rotated back as `in_rotated_basis` does, and equals the general path's launch and the portable attention.
    A bf16 model's steady launches take the float32 rotated query as it is (no cast either side of the kernel):
    its output is q's dtype, within bf16's rounding of the portable attention and of the general path."""
    mx.random.seed(kbits * 10 + vbits)
    cache = CompressedKVCache(CodecSpec("turbo", kbits), CodecSpec("turbo", vbits), start=0, attention=KERNEL)
    cache.update_and_fetch(*(mx.random.normal((1, 2, 150, 64)).astype(dtype) for _ in range(2)))
    sk = mx.random.normal((8,)).astype(dtype) if sinks else None

    def general(q, view):
        attend = lambda qq, v, scale, s: cuda_decode.attend(qq, cuda_decode.view_launches(qq, v), v.heads, scale, s)
        return in_rotated_basis(attend, q, view, 0.125, sk)

    stepped = []
    for step in range(3):
        view, _ = cache.update_and_fetch(*(mx.random.normal((1, 2, 1, 64)).astype(dtype) for _ in range(2)))
        assert view.steady and view.segments[0].joint is None
        assert view.launch is (cuda_decode.kept_launch if step else None)
        q = mx.random.normal((1, 8, 1, 64)).astype(dtype)
        seen = len(QUERY_TYPES)
        got = _sdpa(q, view, view, cache, 0.125, None, sinks=sk)
        assert got.dtype == dtype
        stepped.append(QUERY_TYPES[seen:])
        want = blockwise.kv_attention(q, view, 0.125, sk, config=PORTABLE)
        if dtype == mx.float32:
            assert _close(got, want), step
            assert np.array_equal(np.array(got), np.array(general(q, view))), step
        else:  # bf16 outputs: one rounding of the same attention
            for other in (want, general(q, view)):
                assert np.allclose(np.array(got.astype(mx.float32)), np.array(other.astype(mx.float32)),
                                   atol=2e-2, rtol=2e-2), step
    assert cache.stats.calls.get("cuda-kernel") == 3
    assert stepped == [[dtype], [mx.float32], [mx.float32]]  # kept steps: the rotated query as it is


@pytest.mark.parametrize("specs", [(CodecSpec("affine", 4, 32),), (CodecSpec("turbo", 4), CodecSpec("turbo", 3))],
                         ids=["affine4-joint", "turbo-k4v3"])
def test_packed_rows_launch_from_their_recipe(emulated, specs):
    """Uneven packed rows (the batch engine's decode): the launch from the rows' recipe equals the
    portable attention and the general path, as the rows grow and after one leaves; TurboQuant rows (a key and
    a value set, attended in the rotated basis) launch from their recipe too."""
    mx.random.seed(7)
    rows = []
    for n in (5, 300, 130):
        c = CompressedKVCache(*specs, start=0, attention=KERNEL)
        c.update_and_fetch(mx.random.normal((1, 2, n, 64)), mx.random.normal((1, 2, n, 64)))
        rows.append(c)
    batch = BatchCompressedKVCache(rows)

    def general(q, pv):
        attend = lambda qq, v, scale, sk: cuda_decode.attend(qq, cuda_decode.packed_launches(qq, v), v.heads, scale, sk)
        return in_rotated_basis(attend, q, pv, 0.125, None)

    for step in range(4):
        if step == 2:
            batch.filter([0, 2])
        B = batch.batch_size
        pv, _ = batch.update_and_fetch(mx.random.normal((B, 2, 1, 64)), mx.random.normal((B, 2, 1, 64)))
        assert pv.memo is not None and (pv.joint is not None) == (len(specs) == 1)
        q = mx.random.normal((B, 8, 1, 64))
        got = _sdpa(q, pv, pv, batch, 0.125, None)
        want = blockwise.packed_attention(q, pv, 0.125, None, config=PORTABLE)
        assert _close(got, want), step
        assert np.array_equal(np.array(got), np.array(general(q, pv))), step
    assert any(k[0] == "packed kernel" for k in batch.packed.template.memo if isinstance(k, tuple))


def test_paged_rows_reach_the_kernel_through_their_block_table(emulated):
    """Paged rows with the kernel on ("CUDA"): attention goes to one launch over the pages (the table
    and its width among the inputs), equal to the portable attention, as rows grow, leave and join."""
    mx.random.seed(8)
    cfg = AttentionConfig(cuda_kernel=True, cuda_min_tokens=0, paged=True)

    def row(n):
        c = CompressedKVCache(CodecSpec("affine", 4, 32), start=0, attention=cfg)
        c.update_and_fetch(mx.random.normal((1, 2, n, 64)), mx.random.normal((1, 2, n, 64)))
        return c

    batch = BatchCompressedKVCache([row(n) for n in (5, 300, 130)])
    for step in range(4):
        if step == 1:
            batch.filter([0, 2])
        if step == 2:
            batch.extend(BatchCompressedKVCache([row(129)]))
        B = batch.batch_size
        pv, _ = batch.update_and_fetch(mx.random.normal((B, 2, 1, 64)), mx.random.normal((B, 2, 1, 64)))
        assert type(pv).__name__ == "PagedView"
        q = mx.random.normal((B, 8, 1, 64))
        got = _sdpa(q, pv, pv, batch, 0.125, None)
        want = blockwise.packed_attention(q, pv.packed(), 0.125, None, config=PORTABLE)
        assert _close(got, want), step
    assert batch.packed.template.stats.calls.get("cuda-kernel") == 4
    assert len(emulated) == 4 and all(f for f, _, _ in emulated)  # one fused launch a step
    assert any(isinstance(k, tuple) and k[0] == "paged kernel" for k in batch.packed.template.memo)  # from the recipe


def test_a_view_that_is_not_steady_takes_the_general_path(emulated):
    """Recent tokens (a dense segment beside the encoded one): no recipe, the general launches."""
    mx.random.seed(3)
    cache = CompressedKVCache(CodecSpec("affine", 4, 32), start=0, recent=8, attention=KERNEL)
    cache.update_and_fetch(mx.random.normal((1, 2, 100, 64)), mx.random.normal((1, 2, 100, 64)))
    view, _ = cache.update_and_fetch(mx.random.normal((1, 2, 1, 64)), mx.random.normal((1, 2, 1, 64)))
    assert not view.steady
    q = mx.random.normal((1, 4, 1, 64))
    got = _sdpa(q, view, view, cache, 0.125, None)
    assert _close(got, blockwise.kv_attention(q, view, 0.125, config=PORTABLE))
    assert not any(isinstance(k, tuple) and k[0] == "kernel" for k in cache.memo)


@pytest.mark.skipif(backend_name() != "cuda", reason="the real kernel runs on the CUDA backend only")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=["bf16", "f32"])
def test_the_real_kernel_from_its_recipes(dtype):
    """On CUDA: decode steps of one row and of packed rows through the kept recipes == the portable path."""
    mx.random.seed(11)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == mx.bfloat16 else {"atol": 2e-5, "rtol": 1e-4}
    cache = CompressedKVCache(CodecSpec("affine", 4, 64), start=0, attention=KERNEL)
    rows = [CompressedKVCache(CodecSpec("affine", 4, 64), start=0, attention=KERNEL) for _ in range(3)]
    for c, n in zip([cache, *rows], (700, 5, 300, 1030)):
        c.update_and_fetch(*(mx.random.normal((1, 8, n, 128)).astype(dtype) for _ in range(2)))
    batch = BatchCompressedKVCache(rows)
    for _ in range(3):
        view, _ = cache.update_and_fetch(*(mx.random.normal((1, 8, 1, 128)).astype(dtype) for _ in range(2)))
        q = mx.random.normal((1, 32, 1, 128)).astype(dtype)
        got = _sdpa(q, view, view, cache, 0.088, None)
        assert mx.allclose(got, blockwise.kv_attention(q, view, 0.088, config=PORTABLE), **tol).item()
        pv, _ = batch.update_and_fetch(*(mx.random.normal((3, 8, 1, 128)).astype(dtype) for _ in range(2)))
        q = mx.random.normal((3, 32, 1, 128)).astype(dtype)
        got = _sdpa(q, pv, pv, batch, 0.088, None)
        assert mx.allclose(got, blockwise.packed_attention(q, pv, 0.088, None, config=PORTABLE), **tol).item()
    assert cache.stats.calls.get("cuda-kernel") == 3 and rows[0].stats.calls.get("cuda-kernel") == 3


@pytest.mark.skipif(backend_name() != "cuda", reason="the real kernel runs on the CUDA backend only")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=["bf16", "f32"])
def test_the_real_turbo_kernel_from_its_recipe(dtype):
    """On CUDA: turbo:k4v3 decode steps through the kept launch (the float32 rotated query handed to the
    tensor-core body as it is, its float32 output into the inverse rotation) == the portable path, in q's dtype."""
    mx.random.seed(13)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == mx.bfloat16 else {"atol": 3e-3, "rtol": 3e-3}
    cache = CompressedKVCache(CodecSpec("turbo", 4), CodecSpec("turbo", 3), start=0, attention=KERNEL)
    cache.update_and_fetch(*(mx.random.normal((1, 8, 900, 128)).astype(dtype) for _ in range(2)))
    for step in range(3):
        view, _ = cache.update_and_fetch(*(mx.random.normal((1, 8, 1, 128)).astype(dtype) for _ in range(2)))
        assert view.launch is (cuda_decode.kept_launch if step else None)
        q = mx.random.normal((1, 32, 1, 128)).astype(dtype)
        got = _sdpa(q, view, view, cache, 0.088, None)
        assert got.dtype == dtype
        assert mx.allclose(got, blockwise.kv_attention(q, view, 0.088, config=PORTABLE), **tol).item(), step
    assert cache.stats.calls.get("cuda-kernel") == 3


@pytest.mark.skipif(backend_name() != "cuda", reason="the real kernel runs on the CUDA backend only")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=["bf16", "f32"])
def test_the_real_kernel_over_paged_rows(dtype):
    """On CUDA: paged rows (shuffled pages after a leave and a join) through the block table == portable."""
    mx.random.seed(12)
    cfg = AttentionConfig(cuda_kernel=True, cuda_min_tokens=0, paged=True)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == mx.bfloat16 else {"atol": 2e-5, "rtol": 1e-4}

    def row(n):
        c = CompressedKVCache(CodecSpec("affine", 4, 64), start=0, attention=cfg)
        c.update_and_fetch(*(mx.random.normal((1, 8, n, 128)).astype(dtype) for _ in range(2)))
        return c

    batch = BatchCompressedKVCache([row(n) for n in (700, 5, 1030)])
    for step in range(3):
        if step == 1:
            batch.filter([0, 2])
            batch.extend(BatchCompressedKVCache([row(300)]))
        B = batch.batch_size
        pv, _ = batch.update_and_fetch(*(mx.random.normal((B, 8, 1, 128)).astype(dtype) for _ in range(2)))
        q = mx.random.normal((B, 32, 1, 128)).astype(dtype)
        got = _sdpa(q, pv, pv, batch, 0.088, None)
        want = blockwise.packed_attention(q, pv.packed(), 0.088, None, config=PORTABLE)
        assert mx.allclose(got, want, **tol).item(), step
    assert batch.packed.template.stats.calls.get("cuda-kernel") == 3
