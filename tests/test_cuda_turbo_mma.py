"""TurboQuant rows in the tensor-core decode body (kvcore/attention/cuda_turbo_mma.py) on CPU: one warp's
16-token step emulated lane by lane with the CUDA text's own index formulas (the key words' code pairs
looked up in the book, each score times its token's norm; the value rows read as 16-bit halves at the
lane's byte offset, `chunk_code`'s bit arithmetic, the norms folded into P), placed where PTX's
m16n8k16 layout puts each register, against q . k and P . V over the codec's own rotated-basis decode.
A slip in the 3-bit chunk arithmetic or in which token a norm belongs to shows as a wrong value."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_cuda_mma import LANES, _query_pairs

from kvcore.attention import cuda_kernels, cuda_mma, cuda_turbo_mma
from kvcore.attention.cuda_check import check_plan
from kvcore.attention.cuda_launch import Plan, Side
from kvcore.backend import backend_name
from kvcore.codecs import CodecSpec
from kvcore.codecs.turbo import TurboCodec


def _encoded(bits: int, dim: int, tokens: int, seed: int):
    codec = TurboCodec(CodecSpec("turbo", bits), dim)
    packed, norm = codec.encode(mx.random.normal((1, 1, tokens, dim), key=mx.random.key(seed)))
    ref = np.array(codec.portable_rotated((packed, norm)))[0, 0]  # centroid * norm, the rotated basis
    book = np.float16(np.array(codec.centroids))
    return np.array(packed)[0, 0], np.array(norm.astype(mx.float32))[0, 0, :, 0], book, ref


def _words(row_bytes: np.ndarray) -> list[int]:
    return [int(x) for x in np.ascontiguousarray(row_bytes).view("<u4")]


def _chunk_code(w: list[int], e: int, bits: int) -> int:
    """chunk_code<BITS, E>: code e of a lane's little-endian bit chunk."""
    o = e * bits
    j, sh = o >> 5, o & 31
    u = w[j] >> sh
    if sh + bits > 32:
        u |= (w[j + 1] << (32 - sh)) & 0xFFFFFFFF
    return u & ((1 << bits) - 1)


def _lane_chunk(row: np.ndarray, g: int, vpl: int, bits: int) -> list[int]:
    """_TURBO_VALUE_LOADS: VLB bytes at byte VLB * g, as VLH halves joined into VLW words."""
    vlb = vpl * bits // 8
    vlh, vlw = vlb // 2, (vlb // 2 + 1) // 2
    halves = [int(x) for x in np.ascontiguousarray(row[vlb * g : vlb * g + vlb]).view("<u2")]
    return [halves[2 * j] | ((halves[2 * j + 1] if 2 * j + 1 < vlh else 0) << 16) for j in range(vlw)]


def emulate_turbo_scores(q, kp, kn, book, bits: int) -> np.ndarray:
    """S (query vectors, 16 tokens): form 1's query fragments, the key pairs' codes looked up, times the norms."""
    dim = q.shape[1]
    PPK, WTK, NKB, KM2 = 16 // bits, dim * bits // 32 // 4, dim // 16, ((1 << bits) - 1) * 0x10001
    S = np.zeros((8, 16), np.float32)
    for nb in range(2):
        acc = np.zeros((16, 8), np.float32)
        for i in range(NKB):
            A, B = np.zeros((16, 16), np.float32), np.zeros((16, 8), np.float32)
            j, e = i // (PPK // 2), i % (PPK // 2)
            for g, c in LANES:
                if g < q.shape[0]:
                    A[g, 2 * c : 2 * c + 2], A[g, 2 * c + 8 : 2 * c + 10] = _query_pairs(q, g, c, i, bits, WTK)
                w = _words(kp[8 * nb + g])[WTK * c : WTK * c + WTK]
                for half, shift in ((0, bits * 2 * e), (8, bits * (2 * e + 1))):
                    codes = (w[j] >> shift) & KM2
                    B[2 * c + half : 2 * c + half + 2, g] = book[[codes & 0xFFFF, codes >> 16]]
            acc += A @ B
        for g, c in LANES:
            for z in range(2):
                if g < 8:
                    t = 8 * nb + 2 * c + z
                    S[g, t] = acc[g, 2 * c + z] * kn[t]
    return S


def p_fragment(p, norms=None) -> np.ndarray:
    """P^T's B fragment (16 tokens x 8 query vectors): lane (g, c)'s pb0 / pb1 hold tokens 2c, 2c + 1 and
    2c + 8, 2c + 9 of query vector g, each times its token's norm where `norms` are given (fp16)."""
    B = np.zeros((16, 8), np.float32)
    for g, c in LANES:
        if g < p.shape[0]:
            for t in (2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9):
                B[t, g] = np.float16(p[g, t] * (1.0 if norms is None else norms[t]))
    return B


def value_mma(B: np.ndarray, pair, dv: int) -> np.ndarray:
    """O (query vectors, DV): the value mma of every m-block, A's registers from pair(m, g, c, r) (the two values
    at row g + 8 (r & 1), columns 2c + 8 (r >> 1) ..), read back through the body's write-back formula."""
    NMB, VPL = dv // 16, dv // 8
    out = np.zeros((8, dv), np.float32)
    for m in range(NMB):
        A = np.zeros((16, 16), np.float32)
        for g, c in LANES:
            for r in range(4):
                col = 2 * c + 8 * (r >> 1)
                A[g + 8 * (r & 1), col : col + 2] = pair(m, g, c, r)
        acc = A @ B
        for g, c in LANES:
            for z in range(4):
                v, row = 2 * c + (z & 1), g + 8 * (z >> 1)
                out[v, VPL * (row & 7) + (row >> 3) * NMB + m] = acc[row, v]
    return out


def emulate_turbo_values(p, vp, vn, book, bits: int, dv: int, shift_element: int = 0) -> np.ndarray:
    """O (query vectors, DV): P^T's fragment with each token's norm folded in, the lanes' code chunks looked up."""
    NMB, VPL = dv // 16, dv // 8

    def pair(m, g, c, r):
        e = ((r & 1) * NMB + m + shift_element) % VPL
        ta, tb = 2 * c + 8 * (r >> 1), 2 * c + 8 * (r >> 1) + 1
        return book[[_chunk_code(_lane_chunk(vp[t], g, VPL, bits), e, bits) for t in (ta, tb)]]

    return value_mma(p_fragment(p, vn), pair, dv)


@pytest.mark.parametrize("kbits, vbits, dim", [(4, 3, 128), (4, 4, 128), (8, 3, 256), (2, 2, 64), (4, 8, 64)])
def test_turbo_fragments_give_scores_and_outputs(kbits, vbits, dim):
    assert cuda_turbo_mma.turbo_fits(Side("turbo", kbits, dim, dim), Side("turbo", vbits, dim, dim))
    q = np.array(mx.random.normal((4, dim), key=mx.random.key(3)))
    kp, kn, kbook, kref = _encoded(kbits, dim, 16, 1)
    vp, vn, vbook, vref = _encoded(vbits, dim, 16, 2)
    S = emulate_turbo_scores(q, kp, kn, kbook, kbits)[:4]
    want = np.float16(q).astype(np.float32) @ kref.T
    np.testing.assert_allclose(S, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
    wrong = emulate_turbo_scores(q, kp, np.roll(kn, 1), kbook, kbits)[:4]  # each score times a neighbour's norm
    assert not np.allclose(wrong, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
    p = np.array(mx.softmax(mx.array(want), axis=-1))
    O = emulate_turbo_values(p, vp, vn, vbook, vbits, dim)[:4]
    np.testing.assert_allclose(O, p @ vref, rtol=2e-2, atol=2e-2 * np.abs(p @ vref).max())
    wrong = emulate_turbo_values(p, vp, vn, vbook, vbits, dim, shift_element=1)[:4]  # a slip of one element
    assert not np.allclose(wrong, p @ vref, rtol=2e-2, atol=2e-2 * np.abs(p @ vref).max())


def test_where_the_turbo_body_applies(monkeypatch):
    k4, v3 = Side("turbo", 4, 128, 128), Side("turbo", 3, 128, 128)
    monkeypatch.setenv("MLXKV_CUDA_TURBO_MMA", "0")
    assert not cuda_mma.mma_fits(k4, v3, 4, 1, "bfloat16")  # the knob keeps the scalar body
    monkeypatch.delenv("MLXKV_CUDA_TURBO_MMA", raising=False)  # on by default
    assert cuda_mma.mma_fits(k4, v3, 4, 1, "bfloat16") and cuda_mma.mma_fits(k4, v3, 4, 2, "float16")
    assert cuda_mma.mma_fits(k4, v3, 4, 1, "float32")  # a steady step's rotated query, as it is
    a4 = Side("affine", 4, 64, 128)
    assert cuda_mma.mma_fits(a4, a4, 4, 1, "bfloat16") and not cuda_mma.mma_fits(a4, a4, 4, 1, "float32")
    assert not cuda_mma.mma_fits(k4, Side("turbo", 3, 64, 64), 4, 1, "bfloat16")  # a lane's 24 bits: no halves
    assert not cuda_mma.mma_fits(Side("turbo", 3, 128, 128), v3, 4, 1, "bfloat16")  # 3-bit keys: scalar body
    assert not cuda_mma.mma_fits(k4, Side("affine", 4, 64, 128), 4, 1, "bfloat16")
    monkeypatch.setenv("MLXKV_CUDA_MMA", "3")
    assert not cuda_mma.mma_fits(k4, v3, 4, 1, "bfloat16")  # form 1 only


def test_turbo_plans_hold_their_books_and_build_their_own_text():
    plan = Plan(Side("turbo", 4, 128, 128), Side("turbo", 3, 128, 128), 4, 1, False, 1)
    lay = plan.layout
    assert lay["BOOK"] % 16 == 0 and lay["TOTAL"] == lay["BOOK"] + 2 * (16 + 8)
    assert lay["BOOK"] >= cuda_mma.mma_smem(plan.qvb, 128, 4)  # after the warps' partials
    text = cuda_kernels.body(1, "turbo", 128, 128)
    assert "lut2(kbook" in text and "chunk_code<VB, 15>" in text and "deq2" not in text
    assert text != cuda_kernels.body(1) and "lut2" not in cuda_kernels.body(1)
    assert "lut2" in cuda_kernels.header(True, 4, "turbo") and "lut2" not in cuda_kernels.header(True, 4)


def test_turbo_plans_in_other_forms_are_refused_by_name(monkeypatch):
    monkeypatch.setenv("MLXKV_CUDA_TURBO_MMA", "1")
    k4, v3 = Side("turbo", 4, 128, 128), Side("turbo", 3, 128, 128)
    assert Plan(k4, v3, 4, 1, False, 1).why_not() is None
    assert "form 1 only" in Plan(k4, v3, 4, 1, False, 2).why_not()


@pytest.mark.skipif(backend_name() != "cuda", reason="the real kernel runs on the CUDA backend only")
@pytest.mark.parametrize("kb, vb, dim, rep, n", [(4, 3, 128, 4, 1), (4, 3, 256, 2, 1), (4, 4, 128, 4, 1),
                                                 (8, 8, 128, 8, 1), (2, 2, 64, 4, 1), (4, 3, 128, 4, 2)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_turbo_body_equals_the_reference_on_the_device(monkeypatch, kb, vb, dim, rep, n, dtype):
    """cuda_check's admission check (two uneven rows, splits, sinks, window and lag bounds, strided slices) of
    the turbo body, with fresh inputs too."""
    monkeypatch.setenv("MLXKV_CUDA_TURBO_MMA", "1")
    plan = Plan(Side("turbo", kb, dim, dim), Side("turbo", vb, dim, dim), rep, n, False, 1)
    assert plan.why_not() is None
    for seed in (0, 1):
        assert check_plan(plan, getattr(mx, dtype), seed=seed) is None
