"""Form 4 (kvcore/attention/cuda_ring.py, MLXKV_CUDA_MMA=4, opt-in): form 3's lean loop fed by form 2's shared-memory
ring. On CPU: its text is form 2's ring loop with the lean rescale skip beside the lean loops, chosen once a launch,
and a form-4 plan carries the ring's constants. On CUDA: the ring takes the launches it should (MLXKV_CUDA_RING=only
makes any other launch's outputs NaN), passes the admission check, and gives form 3's outputs bit for bit; paged
rows run the lean loop."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvcore.attention import cuda_kernels, cuda_lean, cuda_ring, cuda_stage
from kvcore.attention.cuda_check import check_inputs, check_plan
from kvcore.attention.cuda_launch import Plan, Side
from kvcore.backend import backend_name


def test_the_ring_body_is_form_2s_ring_loop_beside_the_lean_loops():
    text = cuda_ring.body()
    assert text.count("if (ring_ok) {") == 2  # its first tiles in flight before the queries, then its loop
    assert text.count(cuda_ring._RING_START) == 1 and text.count(cuda_lean._LOOP_START) == 2
    assert text.count("__any_sync(0xffffffffu, cr0 != 1.f || cr1 != 1.f)") == 3  # the ring's and both lean loops'
    ring = cuda_ring.ring_loop()
    loop = cuda_stage.LOOP
    original = loop[loop.index(cuda_ring._RING_START): loop.index(cuda_ring._RING_END) + len(cuda_ring._RING_END)]
    undone = (ring.replace("    if (__any_sync(0xffffffffu, cr0 != 1.f || cr1 != 1.f)) {  // a maximum moved\n", "")
              .replace(cuda_lean._RESCALE + "    }\n", cuda_lean._RESCALE))
    assert undone == original  # form 2's ring loop, character for character, but for the skip
    assert text.index("const bool ring_ok") < text.index("uint32_t qa[NKB][2];")  # set up before the queries
    assert cuda_ring._NOT_TAKEN not in text and cuda_ring._NOT_TAKEN in cuda_ring.body(True)
    scaled = cuda_ring.body(False, True)  # MLXKV_CUDA_DEQ=scaled: every loop's products on scaled codes
    assert scaled.count("deqs(") == 15 and "deq2(" not in scaled.replace("uint32_t deq2(", "")


def test_a_form_4_plan_carries_the_ring(monkeypatch):
    a4 = Side("affine", 4, 64, 128)
    plan = Plan(a4, a4, 4, 1, False, 4)
    assert plan.why_not() is None
    consts = dict(plan.template)
    st = plan.stages
    assert (consts["STG"], consts["STB"], consts["KRS"], consts["VRS"]) == (st.count, st.stage, st.krs, st.vrs)
    assert plan.smem >= 4 * st.count * st.stage
    monkeypatch.delenv("MLXKV_CUDA_RING", raising=False)
    assert cuda_kernels._special(plan) == ("ring", 0, 0)
    monkeypatch.setenv("MLXKV_CUDA_RING", "only")
    assert cuda_kernels._special(plan) == ("ring", 1, 0)
    monkeypatch.setenv("MLXKV_CUDA_DEQ", "scaled")
    assert cuda_kernels._special(plan) == ("ringscaled", 1, 0)
    assert "deqs" in cuda_kernels.header(True, 4, "ringscaled") and "cp_async16z" in cuda_kernels.header(True, 4, "ringscaled")
    monkeypatch.delenv("MLXKV_CUDA_DEQ")
    monkeypatch.setenv("MLXKV_CUDA_MMA", "4")
    from kvcore.attention.cuda_mma import form_for

    assert form_for(a4, a4) == 4
    assert form_for(Side("turbo", 4, 128, 128), Side("turbo", 3, 128, 128)) == 4  # asked for; mma_fits declines
    assert Plan(Side("turbo", 4, 128, 128), Side("turbo", 3, 128, 128), 4, 1, False, 4).why_not() is not None


def _ring_copies(krw: int, vrw: int, kng: int, vng: int, st, nv: int):
    """Every 16-byte copy one tile's `issue` makes, with the CUDA text's formulas: (array, source byte offset from the
    tile's first token, destination byte offset in the stage, bytes read) for each lane's pieces."""
    off = st.offsets(kng, vng)
    out = []
    for lane in range(32):
        for k in range((4 * krw + 31) // 32):  # K rows: piece i is row i / (KRW / 4), column i % (KRW / 4)
            i = lane + 32 * k
            if (4 * krw) % 32 == 0 or i < 4 * krw:
                r, col = i // (krw // 4), i % (krw // 4)
                out.append(("k", 16 * i, (r * st.krs + 4 * col) * 4, 16 if r < nv else 0))
        for k in range((4 * vrw + 31) // 32):
            i = lane + 32 * k
            if (4 * vrw) % 32 == 0 or i < 4 * vrw:
                r, col = i // (vrw // 4), i % (vrw // 4)
                out.append(("v", 16 * i, off["V"] + (r * st.vrs + 4 * col) * 4, 16 if r < nv else 0))
        kmc, vmc = 2 * kng, 2 * vng
        nmc = 2 * kmc + 2 * vmc
        for k in range((nmc + 31) // 32):
            i = min(lane + 32 * k, nmc - 1)
            a = 0 if i < kmc else 1 if i < 2 * kmc else 2 if i < 2 * kmc + vmc else 3
            j = i - a * kmc if a < 2 else i - 2 * kmc - (a - 2) * vmc
            tb = 2 * (kng if a < 2 else vng)
            if nmc % 32 == 0 or lane + 32 * k < nmc:
                out.append(("ks kz vs vz".split()[a], 16 * j, off[("KS", "KZ", "VS", "VZ")[a]] + 16 * j,
                            max(0, min(16, nv * tb - 16 * j))))
    return out


@pytest.mark.parametrize("kbits, vbits, dim, kg, vg", [(4, 4, 128, 64, 64), (8, 4, 128, 64, 32), (2, 2, 256, 64, 64),
                                                        (4, 8, 64, 32, 64), (4, 4, 64, 64, 64), (4, 4, 256, 32, 32)])
@pytest.mark.parametrize("nv", [16, 5, 1])
def test_the_rings_copies_fill_the_stage_as_form_2s_reads_expect(kbits, vbits, dim, kg, vg, nv):
    """A tile copied by `issue`'s formulas (emulated byte for byte) leaves, in every place form 2's loop reads (K rows
    at KRS words, V rows at VRS, the four [16][groups] arrays), the tile's bytes for its first `nv` tokens and zeros
    after them; no two copies write the same bytes, and none reads past the tile's tokens."""
    ks, vs = Side("affine", kbits, kg, dim), Side("affine", vbits, vg, dim)
    plan = Plan(ks, vs, 4, 1, False, 4)
    assert plan.why_not() is None
    st, rng = plan.stages, np.random.default_rng(dim + nv)
    krw, vrw, kng, vng = ks.words, vs.words, ks.groups, vs.groups
    src = {"k": rng.integers(0, 256, 16 * krw * 4, np.uint8), "v": rng.integers(0, 256, 16 * vrw * 4, np.uint8)}
    for name, ng in (("ks", kng), ("kz", kng), ("vs", vng), ("vz", vng)):
        src[name] = rng.integers(0, 256, 16 * ng * 2, np.uint8)
    stage = np.full(st.stage, 0xAB, np.uint8)  # stale bytes of an earlier tile
    written = np.zeros(st.stage, np.int32)
    for name, s_off, d_off, n in _ring_copies(krw, vrw, kng, vng, st, nv):
        piece = np.zeros(16, np.uint8)
        piece[:n] = src[name][s_off : s_off + n]
        stage[d_off : d_off + 16] = piece
        written[d_off : d_off + 16] += 1
        assert s_off + n <= len(src[name]) and (n == 0 or s_off < len(src[name]))
    assert written.max() == 1
    off = st.offsets(kng, vng)
    for r in range(16):
        for name, base, stride, rw in (("k", 0, st.krs, krw), ("v", off["V"], st.vrs, vrw)):
            row = stage[base + r * stride * 4 : base + r * stride * 4 + rw * 4]
            want = src[name][r * rw * 4 : (r + 1) * rw * 4] if r < nv else np.zeros(rw * 4, np.uint8)
            assert (row == want).all(), (name, r)
        for name, key, ng in (("ks", "KS", kng), ("kz", "KZ", kng), ("vs", "VS", vng), ("vz", "VZ", vng)):
            got = stage[off[key] + r * ng * 2 : off[key] + (r + 1) * ng * 2]
            want = src[name][r * ng * 2 : (r + 1) * ng * 2] if r < nv else np.zeros(ng * 2, np.uint8)
            assert (got == want).all(), (name, r)


@pytest.mark.skipif(backend_name() != "cuda", reason="the real kernel runs on the CUDA backend only")
@pytest.mark.parametrize("kb, kg, vb, vg, dim, rep, n, paged", [(4, 64, 4, 64, 128, 4, 1, False),
                                                                (8, 64, 4, 32, 128, 4, 2, False),
                                                                (4, 32, 4, 32, 64, 8, 1, False),
                                                                (4, 64, 8, 64, 256, 2, 3, False),
                                                                (2, 64, 2, 64, 256, 4, 1, False),
                                                                (4, 64, 4, 64, 128, 4, 1, True)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("deq", ["", "scaled"])
def test_the_ring_is_form_3_bit_for_bit_on_the_device(monkeypatch, kb, kg, vb, vg, dim, rep, n, paged, dtype, deq):
    """Form 4 against form 3's lean loop, each on plain or on scaled codes (MLXKV_CUDA_DEQ)."""
    monkeypatch.setenv("MLXKV_CUDA_DEQ", deq)
    q_dtype = getattr(mx, dtype)
    three = Plan(Side("affine", kb, kg, dim), Side("affine", vb, vg, dim), rep, n, paged, 3)
    four = Plan(three.key, three.value, rep, n, paged, 4)
    q, launch, _, sinks, scale, split = check_inputs(three, q_dtype, seed=3)
    monkeypatch.setenv("MLXKV_CUDA_RING", "" if paged else "only")  # paged rows: the lean loop, by design
    outs = []
    for plan in (three, four):
        assert check_plan(plan, q_dtype, seed=1) is None
        outs.append(cuda_kernels.partials(q, launch, plan, scale, 2, split, sinks=sinks, fused=True))
        mx.eval(outs[-1])
    for a, b in zip(*outs):
        assert mx.array_equal(a, b).item()
