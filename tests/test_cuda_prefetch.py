"""Form 1 with the next tile's keys (MLXKV_CUDA_PREFETCH=1), or keys and values (=2), loaded a tile ahead, or asked of L2 (=3)
(kvcore/attention/cuda_prefetch.py): on CPU, that its text is form 1's loop with exactly the loads moved (the same
arithmetic in the same order); on CUDA, that it passes the admission check and gives form 1's outputs bit for bit."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kvcore.attention import cuda_kernels, cuda_mma, cuda_prefetch
from kvcore.attention.cuda_check import check_inputs, check_plan
from kvcore.attention.cuda_launch import Plan, Side
from kvcore.backend import backend_name


def test_the_loop_reads_keys_loaded_a_tile_ahead():
    loop = cuda_prefetch.loop(1)
    assert "uint32_t w[WTK]" not in loop and "__half2 s2[NGT]" not in loop  # no per-tile key registers left
    assert loop.count("load_words<WTK>(wn[nb],") == 2  # before the loop, and one tile ahead inside it
    body = loop[loop.index("for (int t0 = t_begin"):]
    assert body.index("wn[nb][j]") < body.index("t0 + 16 * NWARP < t_end) {") < body.index("load_words<WTV>")
    # what is left once the prefetch's own lines are taken out is form 1's loop, in form 1's order
    for piece in ("float mx = NEG;", "const float corr = exp2f(m_run - mn);", "mma16816(acc[m]"):
        assert loop[loop.index(piece):] == cuda_mma.LOOP[cuda_mma.LOOP.index(piece):]


def test_values_are_loaded_once_their_products_are_done():
    loop = cuda_prefetch.loop(2)
    body = loop[loop.index("for (int t0 = t_begin"):]
    assert loop.count("load_words<WTV>(vwd[k],") == 2 and "uint32_t vwd[4][WTV]" not in body  # before, and ahead
    assert body.index("mma16816(acc[m]") < body.index("load_words<WTV>") and body.index("const int pb = pb_next,") < body.index("load_words<WTV>")
    assert loop.index("uint32_t vwd[4][WTV]") < loop.index("for (int t0 = t_begin")


def test_where_the_prefetch_body_applies(monkeypatch):
    a4 = Side("affine", 4, 64, 128)
    plan = Plan(a4, a4, 4, 1, False, 1)
    monkeypatch.delenv("MLXKV_CUDA_PREFETCH", raising=False)
    assert cuda_kernels._special(plan) == ("", 0, 0)
    monkeypatch.setenv("MLXKV_CUDA_PREFETCH", "1")
    assert cuda_kernels._special(plan) == ("prefetch", 1, 0)
    assert cuda_kernels._special(Plan(a4, a4, 4, 1, False, 3))[0] == "form3"  # form 1 only
    a3 = Side("affine", 3, 64, 128)
    assert cuda_kernels._special(Plan(a3, a3, 4, 1, False, 1))[0] == "chunk"  # its own loop
    text = cuda_kernels.body(1, "prefetch", 1)
    assert "wn[nb][j]" in text and text != cuda_kernels.body(1)
    monkeypatch.setenv("MLXKV_CUDA_PREFETCH", "2")
    assert cuda_kernels._special(plan) == ("prefetch", 2, 0)
    both = cuda_kernels.body(1, "prefetch", 2)
    assert both != text and "wn[nb][j]" in both
    monkeypatch.delenv("MLXKV_CUDA_MIN_BLOCKS", raising=False)
    assert cuda_prefetch.min_blocks(4) == 3 and cuda_prefetch.min_blocks(2) == 2
    monkeypatch.setenv("MLXKV_CUDA_PREFETCH", "3")  # the next tile asked of L2: form 1's loads and registers
    monkeypatch.delenv("MLXKV_CUDA_L2_AHEAD", raising=False)
    assert cuda_kernels._special(plan) == ("prefetch", 3, 1) and cuda_prefetch.min_blocks(4) == 4
    l2 = cuda_kernels.body(1, "prefetch", 3, 1)
    assert l2.count("prefetch.global.L2") == 3 and "wn[nb][j]" not in l2
    one = cuda_prefetch.L2_AHEAD.replace("L2D", "1")
    assert cuda_prefetch.loop(3).replace(one, "") == cuda_mma.LOOP  # nothing else changed
    assert l2.index("prefetch.global.L2") < l2.index("mma16816(s[nb]")
    monkeypatch.setenv("MLXKV_CUDA_L2_AHEAD", "2")  # two of the warp's tiles on: its own kernel
    assert cuda_kernels._special(plan) == ("prefetch", 3, 2)
    assert "16 * NWARP * 2" in cuda_prefetch.loop(3, 2) and cuda_kernels.body(1, "prefetch", 3, 2) != l2
    monkeypatch.setenv("MLXKV_CUDA_MIN_BLOCKS", "4")
    assert cuda_prefetch.min_blocks(4) == 4


@pytest.mark.skipif(backend_name() != "cuda", reason="the real kernel runs on the CUDA backend only")
@pytest.mark.parametrize("kb, kg, vb, vg, dim, rep, n, paged", [(4, 64, 4, 64, 128, 4, 1, False),
                                                                (8, 64, 4, 32, 128, 4, 2, False),
                                                                (2, 32, 2, 32, 64, 8, 1, False),
                                                                (4, 64, 4, 64, 128, 4, 1, True)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("level", ["1", "2", "3", "3-2"])  # 3-2: L2 two of the warp's tiles ahead
def test_the_prefetch_body_is_form_1_bit_for_bit_on_the_device(monkeypatch, kb, kg, vb, vg, dim, rep, n, paged, dtype,
                                                               level):
    plan = Plan(Side("affine", kb, kg, dim), Side("affine", vb, vg, dim), rep, n, paged, 1)
    q_dtype = getattr(mx, dtype)
    q, launch, _, sinks, scale, split = check_inputs(plan, q_dtype, seed=3)
    outs = {}
    monkeypatch.setenv("MLXKV_CUDA_L2_AHEAD", level.partition("-")[2] or "1")
    for on in ("0", level.partition("-")[0]):
        monkeypatch.setenv("MLXKV_CUDA_PREFETCH", on)
        assert check_plan(plan, q_dtype, seed=1) is None
        outs[on] = cuda_kernels.partials(q, launch, plan, scale, 2, split, sinks=sinks, fused=True)
        mx.eval(outs[on])
    for a, b in zip(outs["0"], outs[level.partition("-")[0]]):
        assert mx.array_equal(a, b).item()
