"""TurboQuant rows in form 3's lean loop (kvcore/attention/cuda_turbo3.py, MLXKV_CUDA_TURBO_FORM=3, opt-in). On CPU:
one warp's 16-token step emulated with the text's arrangement (keys as the score mma's A operand, each pair's codes
looked up in the book, the key norms of tokens g and g + 8 on their scores, the value norms on the probabilities
before the shuffles build P^T's fragment) against the codec's rotated-basis attention; where the body applies; the
text is form 3's with turbo's pieces. On CUDA: the admission check against the float32 reference, and the same
outputs as form 1's turbo body within fp16 rounding."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_cuda_mma import LANES, _query_pairs, p_fragments_by_shuffle
from test_cuda_turbo_mma import _chunk_code, _encoded, _lane_chunk, _words, value_mma

from kvcore.attention import cuda_form3, cuda_kernels, cuda_mma, cuda_turbo3
from kvcore.attention.cuda_check import HEADS, check_inputs, check_plan
from kvcore.attention.cuda_launch import Plan, Side
from kvcore.backend import backend_name


def emulate_scores(q, kp, kn, book, bits: int, norm_rows=(0, 8)) -> np.ndarray:
    """S (query vectors, 16 tokens): S^T = K Q^T with the lanes' code pairs of tokens g and g + 8 looked up as A's
    rows, the query fragments as B; token g's scores times the norm of token g + norm_rows[0], g + 8's of
    g + norm_rows[1] (the body: (0, 8))."""
    dim = q.shape[1]
    PPK, WTK, NKB, KM2 = 16 // bits, dim * bits // 32 // 4, dim // 16, ((1 << bits) - 1) * 0x10001
    acc = np.zeros((16, 8), np.float32)
    for i in range(NKB):
        A, B = np.zeros((16, 16), np.float32), np.zeros((16, 8), np.float32)
        j, e = i // (PPK // 2), i % (PPK // 2)
        for g, c in LANES:
            if g < q.shape[0]:
                B[2 * c : 2 * c + 2, g], B[2 * c + 8 : 2 * c + 10, g] = _query_pairs(q, g, c, i, bits, WTK)
            for row in (g, g + 8):
                w = _words(kp[row])[WTK * c : WTK * c + WTK]
                for col, shift in ((2 * c, bits * 2 * e), (2 * c + 8, bits * (2 * e + 1))):
                    codes = (w[j] >> shift) & KM2
                    A[row, col : col + 2] = book[[codes & 0xFFFF, codes >> 16]]
        acc += A @ B
    S = np.zeros((8, 16), np.float32)
    for g, c in LANES:
        for z in range(4):
            tok, v = g + 8 * (z >> 1), 2 * c + (z & 1)
            S[v, tok] = acc[tok, v] * kn[g + norm_rows[z >> 1]]
    return S


def emulate_values(p, vp, vn, book, bits: int, dv: int) -> np.ndarray:
    """O (query vectors, DV): each lane's probabilities of tokens g, g + 8 times those tokens' value norms, packed,
    moved by the four shuffles into P^T's fragment, then turbo's value products (form 1's arrangement)."""
    NMB, VPL = dv // 16, dv // 8
    P = (p * vn[None, :]).T.astype(np.float32)  # (16 tokens, 8 query vectors): the norms of the rows' tokens
    frags = p_fragments_by_shuffle(P)
    B = np.zeros((16, 8), np.float32)
    for (g, c), (b0, b1) in zip(LANES, frags):
        for k, word in enumerate((b0, b1)):
            for h in range(2):
                B[2 * c + 8 * k + h, g] = np.uint16((word >> (16 * h)) & 0xFFFF).view(np.float16)

    def pair(m, g, c, r):
        e = (r & 1) * NMB + m
        ta, tb = 2 * c + 8 * (r >> 1), 2 * c + 8 * (r >> 1) + 1
        return book[[_chunk_code(_lane_chunk(vp[t], g, VPL, bits), e, bits) for t in (ta, tb)]]

    return value_mma(B, pair, dv)


@pytest.mark.parametrize("kbits, vbits, dim", [(4, 3, 128), (4, 4, 128), (8, 3, 256), (2, 2, 64), (4, 8, 64)])
def test_the_step_gives_attention_in_the_rotated_basis(kbits, vbits, dim):
    q = np.array(mx.random.normal((8, dim), key=mx.random.key(3)))
    kp, kn, kbook, kref = _encoded(kbits, dim, 16, 1)
    vp, vn, vbook, vref = _encoded(vbits, dim, 16, 2)
    want = np.float16(q).astype(np.float32) @ kref.T
    tol = lambda x: 2e-2 * np.abs(x).max()
    S = emulate_scores(q, kp, kn, kbook, kbits)
    np.testing.assert_allclose(S, want, rtol=2e-2, atol=tol(want))
    swapped = emulate_scores(q, kp, kn, kbook, kbits, norm_rows=(8, 0))  # each half of the tile the other's norms
    assert not np.allclose(swapped, want, rtol=2e-2, atol=tol(want))
    p = np.array(mx.softmax(mx.array(want), axis=-1))
    O = emulate_values(p, vp, vn, vbook, vbits, dim)
    np.testing.assert_allclose(O, p @ vref, rtol=2e-2, atol=tol(p @ vref))
    plain = emulate_values(p, vp, np.ones_like(vn), vbook, vbits, dim)  # no value norms: not the attention
    assert not np.allclose(plain, p @ vref, rtol=2e-2, atol=tol(p @ vref))


def test_where_turbo_form_3_applies(monkeypatch):
    k4, v3 = Side("turbo", 4, 128, 128), Side("turbo", 3, 128, 128)
    monkeypatch.delenv("MLXKV_CUDA_MMA", raising=False)
    monkeypatch.delenv("MLXKV_CUDA_TURBO_FORM", raising=False)
    assert cuda_mma.form_for(k4, v3) == 1  # form 1's turbo body by default
    assert Plan(k4, v3, 4, 1, False, 3).why_not() is not None
    monkeypatch.setenv("MLXKV_CUDA_TURBO_FORM", "3")
    assert cuda_mma.form_for(k4, v3) == 3 and cuda_mma.mma_fits(k4, v3, 4, 1, "float32")
    plan = Plan(k4, v3, 4, 1, False, 3)
    assert plan.why_not() is None and "BOOK" in plan.layout
    a4 = Side("affine", 4, 64, 128)
    assert cuda_mma.form_for(a4, a4) == 3 and cuda_kernels._special(Plan(a4, a4, 4, 1, False, 3))[0] == "form3"
    assert cuda_kernels._special(plan) == ("turbo3", 1, 128)
    monkeypatch.setenv("MLXKV_CUDA_LEAN", "0")
    assert cuda_kernels._special(plan) == ("turbo3", 0, 128)


def test_the_text_is_form_3_with_turbos_pieces():
    lean, plain = cuda_turbo3.body(128), cuda_turbo3.body(128, lean=False)
    for text in (lean, plain):
        assert "lut2(kbook" in text and "deq2" not in text and "chunk_code<VB, 15>" in text
        assert "(s[0] + s2[0]) * kna" in text and "pack_h2(p0 * vna, p1 * vna)" in text
        assert "mma16816(i & 1 ? s2 : s, a0, a1, a2, a3, qa[i][0], qa[i][1]);" in text  # keys as A
        assert "row_base(kw, 1," in text and "row_base(kw, 4," not in text
    assert lean.count("constexpr bool VEC =") == 2 and "if (kvec) {" in lean and "vvec) {" not in lean
    assert plain.count(cuda_form3.KEY_LOADS) == 0 and "float kna, knb, vna, vnb;" in plain


@pytest.mark.skipif(backend_name() != "cuda", reason="the real kernel runs on the CUDA backend only")
@pytest.mark.parametrize("kb, vb, dim, rep, n", [(4, 3, 128, 4, 1), (4, 3, 256, 2, 1), (4, 4, 128, 4, 1),
                                                 (8, 8, 128, 8, 1), (2, 2, 64, 4, 1), (4, 3, 128, 4, 2)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_turbo_form_3_on_the_device(monkeypatch, kb, vb, dim, rep, n, dtype):
    """The admission check (two uneven rows, splits, sinks, window and lag bounds) and form 1's turbo outputs
    within fp16 rounding (the products run in another order)."""
    monkeypatch.setenv("MLXKV_CUDA_TURBO_FORM", "3")
    q_dtype = getattr(mx, dtype)
    one = Plan(Side("turbo", kb, dim, dim), Side("turbo", vb, dim, dim), rep, n, False, 1)
    three = Plan(one.key, one.value, rep, n, False, 3)
    assert three.why_not() is None
    for seed in (0, 1):
        assert check_plan(three, q_dtype, seed=seed) is None
    q, launch, ref, sinks, scale, split = check_inputs(three, q_dtype, seed=3)
    outs = [cuda_kernels.partials(q, launch, plan, scale, HEADS, split, sinks=sinks, fused=True)[3]
            for plan in (one, three)]
    a, b = (o.astype(mx.float32) for o in outs)
    assert (mx.abs(a - b).max() / mx.abs(a).max()).item() < 3e-3
