"""Form 4 (kvcore/attention/cuda_ring.py, MLXKV_CUDA_MMA=4, opt-in): form 3's lean loop fed by form 2's shared-memory
ring. On CPU: its text is form 2's ring loop with the lean rescale skip beside the lean loops, chosen once a launch,
and a form-4 plan carries the ring's constants. On CUDA: the ring takes the launches it should (MLXKV_CUDA_RING=only
makes any other launch's outputs NaN), passes the admission check, and gives form 3's outputs bit for bit; paged
rows run the lean loop."""

from __future__ import annotations

import mlx.core as mx
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
