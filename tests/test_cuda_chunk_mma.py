"""Affine codes that do not pair within half-words (3, 5, 6 bits) on the tensor-core body
(kvcore/attention/cuda_chunk_mma.py), on CPU: one warp's 16-token step emulated lane by lane with the CUDA
text's index formulas (each lane's natural-order chunk of key and value codes, `chunk_code`, deq2 with the
group's scale and bias, the natural-order query fragments), placed where m16n8k16 puts each register,
against q . k and P . V over the codec's own decode. A slip of one element must fail."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_cuda_mma import LANES, _deq2
from test_cuda_turbo_mma import _chunk_code, _lane_chunk, p_fragment, value_mma

from kvcore.attention import cuda_kernels, cuda_mma
from kvcore.attention.cuda_check import check_plan
from kvcore.attention.cuda_launch import Plan, Side
from kvcore.backend import backend_name
from kvcore.codecs import CodecSpec
from kvcore.codecs.affine import AffineCodec


def _encoded(bits: int, group: int, dim: int, tokens: int, seed: int):
    codec = AffineCodec(CodecSpec("affine", bits, group), dim)
    w, s, b = codec.encode(mx.random.normal((1, 1, tokens, dim), key=mx.random.key(seed)))
    dec = np.array(codec.decode((w, s, b), mx.float32))[0, 0]
    rows = np.ascontiguousarray(np.array(w)[0, 0]).view(np.uint8)  # each token's row as bytes
    return rows, np.array(s.astype(mx.float32))[0, 0], np.array(b.astype(mx.float32))[0, 0], dec


def emulate_scores(q, kr, ks, kz, bits: int, group: int, slip: int = 0) -> np.ndarray:
    dim = q.shape[1]
    KPL, NKB = dim // 4, dim // 16
    S = np.zeros((8, 16), np.float32)
    for nb in range(2):
        acc = np.zeros((16, 8), np.float32)
        for i in range(NKB):
            A, B = np.zeros((16, 16), np.float32), np.zeros((16, 8), np.float32)
            for g, c in LANES:
                d0 = KPL * c + 4 * i
                if g < q.shape[0]:
                    A[g, 2 * c : 2 * c + 2] = np.float16(q[g, [d0, d0 + 1]])
                    A[g, 2 * c + 8 : 2 * c + 10] = np.float16(q[g, [d0 + 2, d0 + 3]])
                t = 8 * nb + g
                w = _lane_chunk(kr[t], c, KPL, bits)
                grp = d0 // group
                sz = ((ks[t, grp],) * 2, (kz[t, grp],) * 2)
                codes = [_chunk_code(w, (4 * i + j + slip) % KPL, bits) for j in range(4)]
                B[2 * c : 2 * c + 2, g] = _deq2(codes[:2], *sz)
                B[2 * c + 8 : 2 * c + 10, g] = _deq2(codes[2:], *sz)
            acc += A @ B
        for g, c in LANES:
            S[g, 8 * nb + 2 * c : 8 * nb + 2 * c + 2] = acc[g, 2 * c : 2 * c + 2]
    return S


def emulate_values(p, vr, vs, vz, bits: int, group: int, dv: int) -> np.ndarray:
    NMB, VPL = dv // 16, dv // 8

    def pair(m, g, c, r):
        e, grp = (r & 1) * NMB + m, VPL * g // group
        ta, tb = 2 * c + 8 * (r >> 1), 2 * c + 8 * (r >> 1) + 1
        codes = [_chunk_code(_lane_chunk(vr[t], g, VPL, bits), e, bits) for t in (ta, tb)]
        return _deq2(codes, (vs[ta, grp], vs[tb, grp]), (vz[ta, grp], vz[tb, grp]))

    return value_mma(p_fragment(p), pair, dv)


@pytest.mark.parametrize("kbits, kg, vbits, vg, dim", [(3, 64, 3, 64, 128), (5, 32, 5, 32, 128), (6, 64, 6, 64, 64),
                                                       (3, 32, 6, 128, 256), (4, 64, 3, 64, 128)])
def test_chunk_fragments_give_scores_and_outputs(monkeypatch, kbits, kg, vbits, vg, dim):
    monkeypatch.setenv("MLXKV_CUDA_CHUNK_MMA", "1")
    key, value = Side("affine", kbits, kg, dim), Side("affine", vbits, vg, dim)
    assert cuda_mma.mma_fits(key, value, 4, 1, "bfloat16") and not cuda_mma.word_fits(key, value)
    q = np.array(mx.random.normal((4, dim), key=mx.random.key(5)))
    kr, ks, kz, kdec = _encoded(kbits, kg, dim, 16, 1)
    vr, vs, vz, vdec = _encoded(vbits, vg, dim, 16, 2)
    want = np.float16(q).astype(np.float32) @ kdec.T
    tol = dict(rtol=2e-2, atol=2e-2 * np.abs(want).max())
    np.testing.assert_allclose(emulate_scores(q, kr, ks, kz, kbits, kg)[:4], want, **tol)
    assert not np.allclose(emulate_scores(q, kr, ks, kz, kbits, kg, slip=1)[:4], want, **tol)
    p = np.array(mx.softmax(mx.array(want), axis=-1))
    ref = p @ vdec
    np.testing.assert_allclose(emulate_values(p, vr, vs, vz, vbits, vg, dim)[:4], ref, rtol=2e-2,
                               atol=2e-2 * np.abs(ref).max())


def test_where_the_chunk_body_applies(monkeypatch):
    a3, a4 = Side("affine", 3, 64, 128), Side("affine", 4, 64, 128)
    monkeypatch.setenv("MLXKV_CUDA_CHUNK_MMA", "0")
    assert not cuda_mma.mma_fits(a3, a3, 4, 1, "bfloat16") and cuda_mma.mma_fits(a4, a4, 4, 1, "bfloat16")
    monkeypatch.delenv("MLXKV_CUDA_CHUNK_MMA", raising=False)  # the default
    assert cuda_mma.mma_fits(a3, a3, 4, 1, "bfloat16") and cuda_mma.mma_fits(a4, a3, 8, 1, "float16")
    assert not cuda_mma.mma_fits(Side("affine", 3, 64, 64), Side("affine", 3, 64, 64), 4, 1, "bfloat16")  # 24-bit V chunks
    assert "form 1 only" in Plan(a3, a3, 4, 1, False, 2).why_not()
    assert cuda_kernels._special(Plan(a3, a3, 4, 1, False, 1)) == ("chunk", 128, 128)
    assert cuda_kernels._special(Plan(a4, a4, 4, 1, False, 1)) == ("", 0, 0)  # form 1's word arrangement
    text = cuda_kernels.body(1, "chunk", 128, 128)
    assert "lane_chunk<KLB>" in text and "chunk_code<VB, 15>" in text and "__byte_perm" not in text


@pytest.mark.skipif(backend_name() != "cuda", reason="the real kernel runs on the CUDA backend only")
@pytest.mark.parametrize("kb, kg, vb, vg, dim, rep, n", [(3, 64, 3, 64, 128, 4, 1), (5, 32, 5, 32, 128, 4, 1),
                                                         (6, 64, 6, 64, 64, 8, 1), (4, 64, 3, 64, 128, 4, 2),
                                                         (3, 32, 6, 128, 256, 2, 1)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_chunk_body_equals_the_reference_on_the_device(monkeypatch, kb, kg, vb, vg, dim, rep, n, dtype):
    monkeypatch.setenv("MLXKV_CUDA_CHUNK_MMA", "1")
    plan = Plan(Side("affine", kb, kg, dim), Side("affine", vb, vg, dim), rep, n, False, 1)
    assert plan.why_not() is None
    for seed in (0, 1):
        assert check_plan(plan, getattr(mx, dtype), seed=seed) is None
