"""The tensor-core decode body (kvcore/attention/cuda_mma.py) on CPU: its fragment arithmetic emulated
lane by lane, with the CUDA text's own index formulas, against plain attention math.

For one warp's 16-token step: each lane's query fragments, dequantized K words (pairs `(t, t + PPK)`
of its own words, the dims permuted) and V words (two tokens' codes joined by the byte permute) are
placed in the 16x16 / 16x8 operand matrices where PTX's m16n8k16 layout puts each register, the
products taken as the tensor cores would, and the outputs read back through the body's write-back
formula. Scores must equal q . k and outputs P . V over the decoded values: any slip in the
permutation shows as a wrong dim.
"""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest
from cuda_emulation import words

from kvcore.attention import cuda_form3, cuda_kernels, cuda_mma, cuda_source, cuda_stage
from kvcore.attention.cuda_launch import Plan, Side
from kvcore.codecs import CodecSpec
from kvcore.codecs.affine import AffineCodec

LANES = [(lane >> 2, lane & 3) for lane in range(32)]  # (g, c)


def _encoded(bits: int, group: int, dim: int, tokens: int, seed: int):
    x = mx.random.normal((1, 1, tokens, dim), key=mx.random.key(seed))
    codec = AffineCodec(CodecSpec("affine", bits, group), dim)
    w, s, b = codec.encode(x)
    dec = np.array(codec.decode((w, s, b), mx.float32))[0, 0]
    return words(w)[0, 0], np.array(s.astype(mx.float32))[0, 0], np.array(b.astype(mx.float32))[0, 0], dec


def _deq2(codes: tuple[int, int], s: tuple[float, float], z: tuple[float, float]) -> tuple[float, float]:
    """deq2: exact codes, one fp16 rounding of scale * code + bias."""
    return tuple(float(np.float16(np.float32(c) * np.float32(sc) + np.float32(zz))) for c, sc, zz in zip(codes, s, z))


def _pair(word: int, shift: int, bits: int) -> tuple[int, int]:
    x = (word >> shift) & (((1 << bits) - 1) * 0x10001)
    return x & 0xFFFF, x >> 16


def _perm(a: int, b: int, sel: int) -> int:
    """__byte_perm(a, b, sel) for the two selectors the body uses."""
    return (a & 0xFFFF) | ((b & 0xFFFF) << 16) if sel == 0x5410 else (a >> 16) | ((b >> 16) << 16)


def _query_pairs(q: np.ndarray, g: int, c: int, i: int, bits: int, wtk: int):
    """Lane (g, c)'s two query registers of k-block i (query vector g; the dims both arrangements permute
    the same way): k columns (2c, 2c + 1), then (2c + 8, 2c + 9)."""
    EPK, PPK = 32 // bits, 16 // bits
    d0 = EPK * (wtk * c + i // (PPK // 2)) + 2 * (i % (PPK // 2))
    return np.float16(q[g, [d0, d0 + PPK]]), np.float16(q[g, [d0 + 1, d0 + 1 + PPK]])


def _key_pairs(kw, ks, kz, t: int, c: int, i: int, bits: int, group: int):
    """Lane (g, c)'s two dequantized key pairs of token t for k-block i, from its own words: k columns
    (2c, 2c + 1), then (2c + 8, 2c + 9)."""
    EPK, PPK, WTK, KPL = 32 // bits, 16 // bits, kw.shape[1] // 4, kw.shape[1] * 8 // bits
    NGT = KPL // group if KPL >= group else 1
    j, e = i // (PPK // 2), i % (PPK // 2)
    w = [int(x) for x in kw[t, WTK * c : WTK * c + WTK]]
    grp = (KPL * c + ((j * EPK) // group if NGT > 1 else 0) * group) // group
    sz = ((ks[t, grp],) * 2, (kz[t, grp],) * 2)
    return _deq2(_pair(w[j], bits * 2 * e, bits), *sz), _deq2(_pair(w[j], bits * (2 * e + 1), bits), *sz)


def emulate_scores(q: np.ndarray, kw, ks, kz, bits: int, group: int) -> np.ndarray:
    """S (query vectors, 16 tokens): the body's Q and K fragments through two n-blocks of mma."""
    WTK, NKB = kw.shape[1] // 4, q.shape[1] // 16
    S = np.zeros((8, 16), np.float32)
    for nb in range(2):
        acc = np.zeros((16, 8), np.float32)
        for i in range(NKB):
            A = np.zeros((16, 16), np.float32)
            B = np.zeros((16, 8), np.float32)
            for g, c in LANES:
                if g < q.shape[0]:
                    A[g, 2 * c : 2 * c + 2], A[g, 2 * c + 8 : 2 * c + 10] = _query_pairs(q, g, c, i, bits, WTK)
                B[2 * c : 2 * c + 2, g], B[2 * c + 8 : 2 * c + 10, g] = _key_pairs(kw, ks, kz, 8 * nb + g, c, i, bits, group)
            acc += A @ B
        for g, c in LANES:
            if g < 8:
                S[g, 8 * nb + 2 * c : 8 * nb + 2 * c + 2] = acc[g, 2 * c : 2 * c + 2]
    return S


def emulate_values(p: np.ndarray, vw, vs, vz, bits: int, group: int, dv: int, frags=None) -> np.ndarray:
    """O (query vectors, DV): P's fragments (as form 1's softmax leaves them, or `frags`: each lane's two
    half2 registers pb0 / pb1) through the body's V fragments."""
    EPV, PPV, WTV, NMB, VPL = 32 // bits, 16 // bits, vw.shape[1] // 8, dv // 16, dv // 8
    B = np.zeros((16, 8), np.float32)
    for lane, (g, c) in enumerate(LANES):
        if frags is not None:
            B[2 * c : 2 * c + 2, g], B[2 * c + 8 : 2 * c + 10, g] = _halves(frags[lane][0]), _halves(frags[lane][1])
        elif g < p.shape[0]:
            B[2 * c : 2 * c + 2, g] = np.float16(p[g, 2 * c : 2 * c + 2])
            B[2 * c + 8 : 2 * c + 10, g] = np.float16(p[g, 2 * c + 8 : 2 * c + 10])
    out = np.zeros((8, dv), np.float32)
    for m in range(NMB):
        A = np.zeros((16, 16), np.float32)
        for g, c in LANES:
            toks = [2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9]
            vwd = [[int(x) for x in vw[t, WTV * g : WTV * g + WTV]] for t in toks]
            grp = (VPL * g) // group
            for r in range(4):
                qq = (r & 1) * NMB + m
                jw, e = qq // EPV, qq % EPV
                wa, wb = vwd[(r >> 1) * 2], vwd[(r >> 1) * 2 + 1]
                x = _perm(wa[jw], wb[jw], 0x5410 if e < PPV else 0x7632)
                ta, tb = toks[(r >> 1) * 2], toks[(r >> 1) * 2 + 1]
                val = _deq2(_pair(x, bits * (e % PPV), bits), (vs[ta, grp], vs[tb, grp]), (vz[ta, grp], vz[tb, grp]))
                row, col = g + 8 * (r & 1), 2 * c + 8 * (r >> 1)
                A[row, col : col + 2] = val
        acc = A @ B  # (16 dims, 8 query vectors)
        for g, c in LANES:
            for z in range(4):
                v, row = 2 * c + (z & 1), g + 8 * (z >> 1)
                d = VPL * (row & 7) + (row >> 3) * NMB + m
                out[v, d] = acc[row, v]
    return out


def emulate_scores_keys_as_a(q: np.ndarray, kw, ks, kz, bits: int, group: int) -> np.ndarray:
    """S (query vectors, 16 tokens) as the staged form takes it, S^T = K Q^T: the same deq pairs of tokens
    g (a0, a2) and g + 8 (a1, a3) as A's rows, the query fragments as B's columns, read back from C's
    layout (lane (g, c): tokens g, g + 8 x query vectors 2c, 2c + 1)."""
    WTK, NKB = kw.shape[1] // 4, q.shape[1] // 16
    acc = np.zeros((16, 8), np.float32)
    for i in range(NKB):
        A = np.zeros((16, 16), np.float32)
        B = np.zeros((16, 8), np.float32)
        for g, c in LANES:
            if g < q.shape[0]:
                B[2 * c : 2 * c + 2, g], B[2 * c + 8 : 2 * c + 10, g] = _query_pairs(q, g, c, i, bits, WTK)
            for row in (g, g + 8):
                A[row, 2 * c : 2 * c + 2], A[row, 2 * c + 8 : 2 * c + 10] = _key_pairs(kw, ks, kz, row, c, i, bits, group)
        acc += A @ B
    S = np.zeros((8, 16), np.float32)
    for g, c in LANES:
        for z in range(4):
            tok, v = g + 8 * (z >> 1), 2 * c + (z & 1)
            S[v, tok] = acc[tok, v]
    return S


def _h2(lo: float, hi: float) -> int:
    return int(np.float16(lo).view(np.uint16)) | (int(np.float16(hi).view(np.uint16)) << 16)


def _halves(x: int) -> tuple[float, float]:
    return tuple(float(np.uint16(v).view(np.float16)) for v in (x & 0xFFFF, x >> 16))


def p_fragments_by_shuffle(P: np.ndarray, src=lambda g, c: 8 * c + (g >> 1)) -> list[tuple[int, int]]:
    """P^T's B fragment per lane as the staged form makes it from its scores' layout: hA / hB (tokens g and
    g + 8, query vectors 2c, 2c + 1 as a half2), four shuffles from lanes 8c + g / 2 and 8c + 4 + g / 2,
    the half of query vector g picked by a byte permute."""
    hA = [_h2(P[g, 2 * c], P[g, 2 * c + 1]) for g, c in LANES]
    hB = [_h2(P[g + 8, 2 * c], P[g + 8, 2 * c + 1]) for g, c in LANES]
    out = []
    for g, c in LANES:
        src0 = src(g, c)
        src1 = src0 + 4
        sel = 0x7632 if g & 1 else 0x5410
        out.append((_perm(hA[src0], hA[src1], sel), _perm(hB[src0], hB[src1], sel)))
    return out


def test_the_staged_forms_shuffles_give_the_value_mma_its_probabilities():
    """Lane (g, c) must end with (P[2c, g], P[2c + 1, g]) and (P[2c + 8, g], P[2c + 9, g]): the B layout the
    value mma reads (the register form builds it directly from its own scores)."""
    P = np.random.default_rng(0).random((16, 8)).astype(np.float32)
    got = p_fragments_by_shuffle(P)
    want = [(_h2(P[2 * c, g], P[2 * c + 1, g]), _h2(P[2 * c + 8, g], P[2 * c + 9, g])) for g, c in LANES]
    assert got == want
    wrong = [(_perm(a, b, 0x5410), 0) for a, b in got]  # negative control: always the low half
    assert [w[0] for w in wrong] != [w[0] for w in want]


CASES = [(4, 64, 128, 4, 64), (8, 64, 128, 8, 64), (2, 64, 128, 2, 64), (4, 32, 64, 4, 32), (4, 32, 256, 4, 32),
         (8, 128, 128, 4, 32), (4, 64, 256, 2, 128)]


@pytest.mark.parametrize("kbits,kg,dim,vbits,vg", CASES)
def test_fragments_give_scores_and_outputs(kbits, kg, dim, vbits, vg):
    assert cuda_mma.mma_fits(Side("affine", kbits, kg, dim), Side("affine", vbits, vg, dim), 4, 2, "bfloat16")
    kw, ks, kz, kdec = _encoded(kbits, kg, dim, 16, 1)
    vw, vs, vz, vdec = _encoded(vbits, vg, dim, 16, 2)
    q = np.array(mx.random.normal((8, dim), key=mx.random.key(3)))
    S = emulate_scores(q, kw, ks, kz, kbits, kg)
    ref = np.float16(q).astype(np.float32) @ kdec.T
    assert np.abs(S - ref).max() <= 2e-3 * np.abs(ref).max() + 1e-3
    S2 = emulate_scores_keys_as_a(q, kw, ks, kz, kbits, kg)  # the staged form's arrangement
    assert np.abs(S2 - ref).max() <= 2e-3 * np.abs(ref).max() + 1e-3
    p = np.exp(ref - ref.max(axis=1, keepdims=True))
    out = emulate_values(p, vw, vs, vz, vbits, vg, dim)
    ref_out = p @ vdec
    assert np.abs(out - ref_out).max() <= 3e-3 * np.abs(ref_out).max()


def test_where_the_tensor_core_body_applies(monkeypatch):
    A = lambda bits, d=128, g=64: Side("affine", bits, g, d)
    fits = cuda_mma.mma_fits
    assert fits(A(4), A(4), 4, 1, "bfloat16") and fits(A(8), A(4, g=32), 1, 8, "float16")
    assert not fits(A(4), A(4), 4, 1, "float32")  # fp32 queries keep the scalar body's precision
    assert not cuda_mma.word_fits(A(3), A(3)) and fits(A(3), A(3), 4, 1, "bfloat16")  # codes across words: the chunk body
    assert not fits(A(4), A(4), 4, 4, "bfloat16")  # 16 query vectors > 8 rows
    assert not cuda_mma.word_fits(A(4, d=128, g=4), A(4)) and fits(A(4, d=128, g=4), A(4), 4, 1, "bfloat16")  # a K word spans groups: the chunk body
    assert not fits(Side("turbo", 4, 128, 128), A(4), 4, 1, "bfloat16")
    monkeypatch.setenv("MLXKV_CUDA_MMA", "0")
    assert not fits(A(4), A(4), 4, 1, "bfloat16")
    monkeypatch.setenv("MLXKV_CUDA_MMA", "1")
    monkeypatch.setenv("MLXKV_CUDA_CHUNK_MMA", "0")
    assert not fits(A(3), A(3), 4, 1, "bfloat16") and not fits(A(4, d=128, g=4), A(4), 4, 1, "bfloat16")


def test_mma_plans_tile_and_share_the_merge():
    plan = Plan(Side("affine", 4, 64, 128), Side("affine", 4, 64, 128), 4, 1, mma=True)
    assert plan.tile == cuda_mma.MMA_TILE and plan.layout["KT"] == 0 and plan.why_not() is None
    assert plan.merges_in_launch(256) and hash(plan) != hash(Plan(plan.key, plan.value, 4, 1))
    text = cuda_kernels.body(True)
    arrival = "fence.acq_rel.gpu" if cuda_source.ARRIVE == "release" else "atomicAdd"
    assert "mma16816" in text and arrival in text  # the tensor-core body, then the shared merge tail
    head = cuda_kernels.header(True)  # ends by giving the kernel MLX declares next its launch bounds
    assert head.rstrip().endswith(f"__launch_bounds__(128, {cuda_mma.MIN_BLOCKS})") and "__launch_bounds__" not in cuda_kernels.header(False)
    assert cuda_mma.min_blocks(128) == 4 and cuda_mma.min_blocks(256) == 2
    staged = cuda_kernels.body(2)
    assert "cp_async_wait" in staged and "cp_async_wait" not in text and staged.count("mma16816(") == text.count("mma16816(")
    staged_plan = Plan(plan.key, plan.value, 4, 1, mma=2)
    names = {n for n, _ in staged_plan.template} | {"FUSED", "HAS_SINK", "OT"}
    assert "KRS" not in {n for n, _ in plan.template}  # the register form is compiled without the ring's constants
    local = {"NEG", "QVT", "NWARP", "CHUNK", "NSPLIT", "VH", "PTW", "HQ", "D4", "EPK", "PPK", "WTK", "NKB", "EPV",
             "PPV", "WTV", "NMB", "KPL", "VPL", "NGT", "KM2", "VM2", "L2E", "LN2", "N", "CPR", "RW", "RS", "NG"}
    used = set(re.findall(r"\b([A-Z][A-Z0-9_]{1,})\b", cuda_mma.BODY + cuda_stage.BODY)) - local
    assert {"KRS", "VRS", "STG", "STB", "SOFF_V", "SOFF_KS", "SOFF_VZ"} <= names
    assert used <= names, used - names


def test_the_staged_form_is_chosen_by_name(monkeypatch):
    """MLXKV_CUDA_MMA=2: the same plan in the form that stages each warp's tiles in a shared-memory ring
    (more of it, its own kernel object); 0: the scalar body; 1: form 1 (unset: form 3, `form_for`)."""
    from kvcore.attention import cuda_decode

    A = Side("affine", 4, 64, 128)
    monkeypatch.setenv("MLXKV_CUDA_MMA", "1")
    monkeypatch.delenv("MLXKV_CUDA_STAGES", raising=False)
    one = cuda_decode.plan_for(A, A, 4, 1, False, mx.bfloat16)
    monkeypatch.setenv("MLXKV_CUDA_MMA", "2")
    two = cuda_decode.plan_for(A, A, 4, 1, False, mx.bfloat16)
    monkeypatch.setenv("MLXKV_CUDA_MMA", "0")
    off = cuda_decode.plan_for(A, A, 4, 1, False, mx.bfloat16)
    assert (one.mma, two.mma, off.mma) == (1, 2, 0) and len({one, two, off}) == 3
    st = two.stages  # 16 tokens of K (64 B rows), V (80 B rows: no bank conflicts), 2 groups of scales and biases
    assert (st.krs, st.vrs, st.count) == (16, 20, 4) and st.stage == 16 * (16 + 20) * 4 + 4 * 64
    assert two.smem == 4 * st.count * st.stage > one.smem and ("MMA", 2) in two.template and ("STG", 4) in two.template
    assert two.tile == one.tile == cuda_mma.MMA_TILE and off.tile != cuda_mma.MMA_TILE


def emulate_form3_step(q, kw, ks, kz, vw, vs, vz, kbits, kg, vbits, vg, dim, src=lambda g, c: 8 * c + (g >> 1)):
    """Form 3's 16-token step end to end: S^T = K Q^T (keys as A, read back from C's layout), the softmax per
    query vector (the max the body's xor 4 / 8 / 16 reductions give each lane), P^T's fragment built from the
    scores' layout by the four shuffles (source lanes `src`), then the value mma on those registers."""
    S = emulate_scores_keys_as_a(q, kw, ks, kz, kbits, kg)  # (8 query vectors, 16 tokens)
    p = np.exp2(S - S.max(axis=1, keepdims=True))
    frags = p_fragments_by_shuffle(p.T.astype(np.float32), src)  # P as (16 tokens, 8 query vectors)
    return emulate_values(None, vw, vs, vz, vbits, vg, dim, frags), p


@pytest.mark.parametrize("kbits,kg,dim,vbits,vg", [CASES[0], CASES[2], CASES[5], CASES[6]])
def test_form3_step_gives_attention(kbits, kg, dim, vbits, vg):
    """Form 3's arithmetic chained (scores, softmax in their layout, shuffles, values) equals softmax(q K^T) V
    over the decoded K/V; a shuffle from the wrong lanes does not."""
    kw, ks, kz, kdec = _encoded(kbits, kg, dim, 16, 4)
    vw, vs, vz, vdec = _encoded(vbits, vg, dim, 16, 5)
    q = np.array(mx.random.normal((8, dim), key=mx.random.key(6))) * 0.2
    out, p = emulate_form3_step(q, kw, ks, kz, vw, vs, vz, kbits, kg, vbits, vg, dim)
    s = np.float16(q).astype(np.float32) @ kdec.T
    ref = np.exp2(s - s.max(axis=1, keepdims=True)) @ vdec
    assert np.abs(out - ref).max() <= 5e-3 * np.abs(ref).max()
    bad, _ = emulate_form3_step(q, kw, ks, kz, vw, vs, vz, kbits, kg, vbits, vg, dim, lambda g, c: 8 * c + (g & 3))
    assert np.abs(bad - ref).max() > 5e-2 * np.abs(ref).max()


def test_form3_is_form2_arithmetic_with_form1_loads(monkeypatch):
    """MLXKV_CUDA_MMA=3: form 2's score / softmax / shuffle text (the formulas emulated above) with form 1's
    global loads, form 1's shared memory and constants (no ring), its own kernel object."""
    text, one, two = cuda_kernels.body(3), cuda_kernels.body(1), cuda_kernels.body(2)
    for piece in (cuda_stage.KEY_MMA, cuda_stage.SOFTMAX, cuda_stage.PARTIALS, cuda_mma.VALUE_LOADS, cuda_mma.VALUES):
        assert cuda_kernels.src.compact(piece) in text
    assert "src0 = 8 * c + (g >> 1), src1 = src0 + 4;" in text and "(g & 1) ? 0x7632u : 0x5410u" in text
    assert "t0 + 8 * r + g" in text and "mma16816(i & 1 ? s2 : s, a0, a1, a2, a3, qa[i][0], qa[i][1]);" in text
    assert "cp_async" not in text and "KRS" not in text and "0u, qa[i][1], 0u" not in text
    assert text.count("mma16816(") == two.count("mma16816(") == one.count("mma16816(") and len({text, one, two}) == 3
    local = {"NEG", "QVT", "NWARP", "CHUNK", "NSPLIT", "VH", "PTW", "HQ", "D4", "EPK", "PPK", "WTK", "NKB", "EPV",
             "PPV", "WTV", "NMB", "KPL", "VPL", "NGT", "KM2", "VM2", "L2E", "LN2"}
    from kvcore.attention import cuda_decode

    A = Side("affine", 4, 64, 128)
    monkeypatch.setenv("MLXKV_CUDA_MMA", "1")
    first = cuda_decode.plan_for(A, A, 4, 1, False, mx.bfloat16)
    monkeypatch.setenv("MLXKV_CUDA_MMA", "3")
    third = cuda_decode.plan_for(A, A, 4, 1, False, mx.bfloat16)
    assert (first.mma, third.mma) == (1, 3) and third != first and ("MMA", 3) in third.template
    assert third.smem == first.smem and third.tile == first.tile and third.why_not() is None
    names = {n for n, _ in third.template} | {"FUSED", "HAS_SINK", "OT"}
    used = set(re.findall(r"\b([A-Z][A-Z0-9_]{1,})\b", cuda_form3.BODY)) - local
    assert used <= names, used - names
    monkeypatch.setenv("MLXKV_CUDA_MMA", "5")  # unknown forms fall back to the default
    assert cuda_mma.variant() is None and cuda_decode.plan_for(A, A, 4, 1, False, mx.bfloat16) == third


def test_the_default_form_is_form_3_where_it_covers_and_form_1_elsewhere(monkeypatch):
    """Unset MLXKV_CUDA_MMA: affine sides whose codes pair within half-words run form 3 (run 19: 2-3% under form 1
    at 32k-128k); turbo sides and affine code chunks keep form 1's bodies (the only form that has them), so they
    stay on the tensor cores rather than falling to the scalar body; an explicit form still decides."""
    from kvcore.attention import cuda_decode

    monkeypatch.delenv("MLXKV_CUDA_MMA", raising=False)
    A = lambda bits, d=128, g=64: Side("affine", bits, g, d)
    T4, T3 = Side("turbo", 4, 128, 128), Side("turbo", 3, 128, 128)
    plan = lambda k, v, dt=mx.bfloat16: cuda_decode.plan_for(k, v, 4, 1, False, dt)
    assert plan(A(4), A(4)).mma == plan(A(8), A(2)).mma == 3 and plan(A(4), A(4)).paged is False
    assert cuda_decode.plan_for(A(4), A(4), 4, 1, True, mx.bfloat16).mma == 3  # paged rows too
    assert plan(A(3), A(3)).mma == 1 and plan(A(4, g=4), A(4)).mma == 1  # code chunks: form 1's body
    assert plan(T4, T3).mma == 1 and plan(T4, T3, mx.float32).mma == 1  # turbo: form 1's body, f32 rotated queries
    assert plan(A(4), A(4), mx.float32).mma == 0  # fp32 affine queries keep the scalar body
    monkeypatch.setenv("MLXKV_CUDA_MMA", "1")
    assert plan(A(4), A(4)).mma == 1 and plan(T4, T3).mma == 1
    monkeypatch.setenv("MLXKV_CUDA_MMA", "2")
    assert plan(A(4), A(4)).mma == 2 and plan(T4, T3).mma == 0  # turbo has no staged body: the scalar one
