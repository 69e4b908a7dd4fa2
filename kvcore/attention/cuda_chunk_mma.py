"""Affine K/V whose codes do not pair within 16-bit halves (3, 5 and 6 bits, or any mix with them) on the
tensor-core decode body (form 1, `cuda_mma.LOOP`), the default since run 11 checked it on the H200 (equal to
the reference in bf16 and fp16) and timed it at 1.47x the scalar body at 128k (affine:3, 164 against 242 us a
launch); `MLXKV_CUDA_CHUNK_MMA=0` gives them the scalar body (~3 500 instructions per token).

Form 1 permutes a lane's dims so that it dequantizes whole words (element pairs (t, t + 16 / bits) of
a word): that needs 16 / bits whole. This body gives each lane whole dims instead, in natural order:
- keys: lane (g, c) reads the KPL = D / 4 codes of token g at bits [KPL * KB * c, KPL * KB * (c + 1))
  of the row (`lane_chunk`: 32-bit loads where the lane's bytes are a multiple of 4, else 16-bit ones);
  k-block i takes its elements 4i .. 4i + 3 (dims KPL c + 4i ..), so the query fragments are built in
  the same natural order (QUERIES below), scale and bias per key group as in form 1;
- values: lane (g, c) reads the VPL = DV / 8 codes of tokens (2c, 2c + 1, 2c + 8, 2c + 9) at bits
  [VPL * VB * g, ..): the same dims as form 1 (VPL g + e), so form 1's P^T fragment and write-back serve.
Codes come out of the lane's chunk by `chunk_code` (cuda_turbo_mma.HEADER: a shift, a funnel where a
code crosses a word, a mask), the element index spelled out per k-block and m-block so it is a
compile-time constant.
"""

from __future__ import annotations

import os

from .cuda_mma import (KEY_LOAD, KEY_MMA, LOOP, MERGE, PRELUDE, VALUE_DECL, VALUE_LOADS, VALUE_PAIRS, VALUE_WORDS, VALUES)

CHUNK_BITS = (2, 3, 4, 5, 6, 8)


def enabled() -> bool:
    return os.environ.get("MLXKV_CUDA_CHUNK_MMA", "1") == "1"


def chunk_fits(key, value) -> bool:
    """Whether this body covers these affine sides: whole 16-bit halves per lane chunk, one value group per
    lane, key groups of whole k-blocks."""
    if key.kind != "affine" or value.kind != "affine" or key.bits not in CHUNK_BITS or value.bits not in CHUNK_BITS:
        return False
    kpl, vpl = key.dim // 4, value.dim // 8
    return (key.dim % 64 == 0 and value.dim % 64 == 0 and key.dim <= 256 and value.dim <= 256
            and kpl * key.bits % 16 == 0 and vpl * value.bits % 16 == 0 and value.group % vpl == 0
            and key.group % 4 == 0 and (key.group % kpl == 0 or kpl % key.group == 0))


HEADER = r"""
// NB bytes of a lane's codes (4-byte aligned where NB is a multiple of 4, else 2-byte) as little-endian words
template <int NB>
__device__ __forceinline__ void lane_chunk(uint32_t* dst, const unsigned char* p) {
  if constexpr (NB % 4 == 0) {
#pragma unroll
    for (int j = 0; j < NB / 4; j++) dst[j] = reinterpret_cast<const uint32_t*>(p)[j];
  } else {
    const unsigned short* hp = reinterpret_cast<const unsigned short*>(p);
#pragma unroll
    for (int j = 0; j < (NB / 2 + 1) / 2; j++) {
      const uint32_t lo = hp[2 * j];
      dst[j] = 2 * j + 1 < NB / 2 ? lo | (static_cast<uint32_t>(hp[2 * j + 1]) << 16) : lo;
    }
  }
}
"""

SIZES = r"""
  constexpr int KLB = KPL * KB / 8, KLW = (KLB + 3) / 4, VLB = VPL * VB / 8, VLW = (VLB + 3) / 4;  // lane chunks
"""

QUERIES = r"""
  // query fragments in natural order: k-block i of lane c is dims KPL c + 4i .. 4i + 3 (k columns 2c, 2c + 1,
  // then 2c + 8, 2c + 9)
  uint32_t qa[NKB][2];
  {
    const int v = qc * QVB + min(g, QVB - 1);
    const long long qo = b * q_strides[0] + (h * REP + v / NQ) * q_strides[1] + (v % NQ) * q_strides[2];
    const float sc = g < QVB ? scale * L2E : 0.f;
#pragma unroll
    for (int i = 0; i < NKB; i++) {
      const int d0 = KPL * c + 4 * i;
      qa[i][0] = pack_h2(static_cast<float>(q[qo + d0 * q_strides[3]]) * sc,
                         static_cast<float>(q[qo + (d0 + 1) * q_strides[3]]) * sc);
      qa[i][1] = pack_h2(static_cast<float>(q[qo + (d0 + 2) * q_strides[3]]) * sc,
                         static_cast<float>(q[qo + (d0 + 3) * q_strides[3]]) * sc);
    }
  }
"""

_CHUNK_KEY_LOAD = r"""      uint32_t w[KLW];
      lane_chunk<KLB>(w, row_base(kw, 4, kw_strides.data(), pb, h) + tp * ktb + KLB * c);
"""
_CHUNK_VALUE_DECL = r"""    uint32_t vwd[4][VLW];
"""
_CHUNK_VALUE_WORDS = r"""      lane_chunk<VLB>(vwd[k], row_base(vw, 4, vw_strides.data(), pb, h + VH) + tp * vtb + VLB * g);
"""


def _key_pairs(nkb: int) -> str:
    """b0 / b1 of k-block i: elements (4i, 4i + 1) and (4i + 2, 4i + 3) of the lane's key chunk."""
    out = ["uint32_t b0 = 0u, b1 = 0u;"]
    for i in range(nkb):
        u = f"NGT > 1 ? {4 * i} / KG : 0"
        out.append(f"if (i == {i}) {{ b0 = deq2(chunk_code<KB, {4 * i}>(w) | (chunk_code<KB, {4 * i + 1}>(w) << 16), "
                   f"s2[{u}], z2[{u}]); b1 = deq2(chunk_code<KB, {4 * i + 2}>(w) | (chunk_code<KB, {4 * i + 3}>(w) << 16), "
                   f"s2[{u}], z2[{u}]); }}")
    return "        " + "\n        ".join(out) + "\n"


def _value_pairs(nmb: int) -> str:
    """a[r] of m-block m: element (r & 1) NMB + m of tokens (2 (r >> 1), 2 (r >> 1) + 1), as form 1 places them."""
    out = []
    for m in range(nmb):
        out.append(f"if (m == {m}) {{")
        for r in range(4):
            e, ka, kb = (r & 1) * nmb + m, 2 * (r >> 1), 2 * (r >> 1) + 1
            s, z = ("sB", "zB") if r >> 1 else ("sA", "zA")
            out.append(f"  a[{r}] = deq2(chunk_code<VB, {e}>(vwd[{ka}]) | (chunk_code<VB, {e}>(vwd[{kb}]) << 16), {s}, {z});")
        out.append("}")
    return "        " + "\n        ".join(out) + "\n"


def body(key_dim: int, value_dim: int) -> str:
    loop, values, loads = LOOP, VALUES, VALUE_LOADS
    for old, new in ((KEY_LOAD, _CHUNK_KEY_LOAD), (KEY_MMA, _key_pairs(key_dim // 16))):
        assert loop.count(old) == 1, old[:60]
        loop = loop.replace(old, new)
    for old, new in ((VALUE_DECL, _CHUNK_VALUE_DECL), (VALUE_WORDS, _CHUNK_VALUE_WORDS)):
        assert loads.count(old) == 1, old[:60]
        loads = loads.replace(old, new)
    assert values.count(VALUE_PAIRS) == 1
    values = values.replace(VALUE_PAIRS, _value_pairs(value_dim // 16))
    for old, new in ((VALUE_LOADS, loads), (VALUES, values)):
        assert loop.count(old) == 1
        loop = loop.replace(old, new)
    return PRELUDE + SIZES + QUERIES + loop + MERGE
