"""The staged form of the tensor-core body (`MLXKV_CUDA_MMA=2`): each warp keeps a ring of `stages`
16-token tiles of packed K/V and their scales in shared memory, filled with `cp.async` (no registers
held by loads in flight), so `stages - 1` tiles are on their way from DRAM while one is computed.
The register form (1) has a warp's K loads, then its V loads, as the only bytes in flight: at 32k
tokens it reads ~0.5 TB/s of the card's ~4.3.

Per warp and stage (32-bit words; `krs` / `vrs` row strides chosen so the fragment reads are free of
shared-memory bank conflicts, `bank_wavefronts` checks it on CPU):
```
K rows [16][krs] | V rows [16][vrs] | K scales [16][KNG] | K biases | V scales [16][VNG] | V biases
```
Pure Python (the layout) and the device functions that fill a stage (`HEADER`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .cuda_mma import MERGE, PRELUDE, QUERIES, VALUES

TOKENS = 16  # a warp's tile: one mma n-block pair of keys, one k-block of values
BANKS = 32
STAGE_SMEM = 48 * 1024  # bytes of rings per block: 4 blocks of 128 threads per SM stay resident
MAX_STAGES = 4
MAX_RING = 96 * 1024  # what MLXKV_CUDA_STAGES may ask for (the plan's shared memory stays under cuda_launch.MAX_SMEM)


def _align16(n: int) -> int:
    return -(-n // 16) * 16


def bank_wavefronts(lanes: list[list[int]], width: int) -> int:
    """Shared-memory wavefronts of one warp-wide read: `lanes[i]` the first 32-bit word lane i reads,
    `width` words each (1, 2 or 4: LDS.32 / .64 / .128 run 32, 16 or 8 lanes per phase); in each phase
    a bank serves one distinct word per wavefront."""
    per = BANKS // width
    total = 0
    for p in range(0, len(lanes), per):
        banks: dict[int, set[int]] = {}
        for first in lanes[p : p + per]:
            for w in range(first, first + width):
                banks.setdefault(w % BANKS, set()).add(w)
        total += max(len(s) for s in banks.values())
    return total


def key_reads(stride: int, words_per_lane: int) -> list[tuple[list[int], int]]:
    """The body's K fragment reads: lane (g, c) reads words [wtk c, wtk c + wtk) of row g (as 16-byte
    pieces where wtk allows)."""
    width = min(words_per_lane, 4)
    return [([(lane >> 2) * stride + words_per_lane * (lane & 3) + piece for lane in range(32)], width)
            for piece in range(0, words_per_lane, width)]


def value_reads(stride: int, words_per_lane: int) -> list[tuple[list[int], int]]:
    """The body's V reads: lane (g, c) reads words [wtv g, wtv g + wtv) of rows 2c, 2c + 1, 2c + 8, 2c + 9."""
    width = min(words_per_lane, 4)
    out = []
    for k in range(4):
        for piece in range(0, words_per_lane, width):
            rows = [2 * (lane & 3) + (k & 1) + 8 * (k >> 1) for lane in range(32)]
            out.append(([r * stride + words_per_lane * (lane >> 2) + piece for r, lane in zip(rows, range(32))], width))
    return out


def row_stride(words: int, reads) -> int:
    """The smallest row stride >= `words`, a multiple of 4 words (16-byte rows for cp.async), whose
    reads run one wavefront per phase."""
    for stride in range(words, words + 33, 4):
        if all(bank_wavefronts(lanes, w) == len(lanes) // (BANKS // w) for lanes, w in reads(stride)):
            return stride
    return words


@dataclass(frozen=True)
class Stages:
    krs: int  # K row stride (words)
    vrs: int
    stage: int  # bytes of one stage
    count: int  # stages per warp ring

    def offsets(self, kng: int, vng: int) -> dict[str, int]:
        k = TOKENS * self.krs * 4
        v = k + TOKENS * self.vrs * 4
        km, vm = _align16(TOKENS * kng * 2), _align16(TOKENS * vng * 2)
        return {"KS": v, "KZ": v + km, "VS": v + 2 * km, "VZ": v + 2 * km + vm, "V": k}


def stages(key_words: int, value_words: int, key_groups: int, value_groups: int, warps: int) -> Stages:
    """The ring of a plan: strides free of bank conflicts, as many stages (2..4) as fit STAGE_SMEM."""
    krs = row_stride(key_words, lambda s: key_reads(s, key_words // 4))
    vrs = row_stride(value_words, lambda s: value_reads(s, value_words // 8))
    size = TOKENS * (krs + vrs) * 4 + 2 * _align16(TOKENS * key_groups * 2) + 2 * _align16(TOKENS * value_groups * 2)
    count = max(2, min(MAX_STAGES, STAGE_SMEM // (warps * size)))
    ask = os.environ.get("MLXKV_CUDA_STAGES", "")  # a device A/B of the ring's depth (read when a plan is made)
    if ask.isdigit() and 2 <= int(ask) <= 8 and warps * size * int(ask) <= MAX_RING:
        count = int(ask)
    return Stages(krs, vrs, size, count)


HEADER = r"""
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(s), "l"(src));
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" :: "r"(s), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

// 16 token rows of RW words from global (`tile` = row 0; rows past `last` repeat row `last`) into rows of RS words
template <int RW, int RS>
__device__ __forceinline__ void stage_rows(unsigned char* dst, const unsigned char* tile, long long tb, int last,
                                           int lane, bool vec) {
  if (vec) {
    constexpr int CPR = RW / 4, N = 16 * CPR;
#pragma unroll
    for (int k = 0; k < (N + 31) / 32; k++) {
      const int i = lane + 32 * k;
      if (N % 32 == 0 || i < N) {
        const int r = i / CPR, col = i % CPR;
        cp_async16(dst + (r * RS + 4 * col) * 4, tile + min(r, last) * tb + 16 * col);
      }
    }
  } else {
    constexpr int N = 16 * RW;
#pragma unroll 4
    for (int i = lane; i < N; i += 32) {
      const int r = i / RW, col = i % RW;
      cp_async4(dst + (r * RS + col) * 4, tile + min(r, last) * tb + 4 * col);
    }
  }
}

// whether NG halves per token lie contiguous and 16-byte aligned for every row and page (checked once a launch)
template <int NG>
__device__ __forceinline__ bool meta_fast(const __half* src, const int64_t* st) {
  return st[3] == 1 && st[2] == NG && ((reinterpret_cast<unsigned long long>(src) | (st[0] * 2ull) | (st[1] * 2ull)) % 16) == 0;
}

// 16 tokens' NG halves (scales or biases) into [16][NG]: 16-byte copies where `fast`, else element by element
template <int NG>
__device__ __forceinline__ void stage_meta(unsigned char* dst, const __half* src, const int64_t* st, int pb, int h,
                                           int tp0, int last, int lane, bool fast) {
  const __half* base = src + pb * st[0] + h * st[1];
  if (fast && last == 15) {
    constexpr int N = 16 * NG * 2 / 16;
    if (lane < N) cp_async16(dst + 16 * lane, reinterpret_cast<const unsigned char*>(base + (long long)tp0 * NG) + 16 * lane);
  } else {
    for (int i = lane; i < 16 * NG; i += 32) {
      const int r = i / NG, gi = i % NG;
      reinterpret_cast<__half*>(dst)[i] = base[(long long)(tp0 + min(r, last)) * st[2] + gi * st[3]];
    }
  }
}
"""


# the pieces of form 2's loop that form 3 (cuda_form3.py) shares: this lane's query vectors and running max / sum;
LANE_QUERIES = r"""
  const int n0 = 2 * c, n1 = 2 * c + 1;  // this lane's query vectors
  const bool real0 = n0 < QVB, real1 = n1 < QVB;
  const int qn0 = (qc * QVB + n0) % NQ, qn1 = (qc * QVB + n1) % NQ;
  float m0 = NEG, m1 = NEG, l0 = 0.f, l1 = 0.f;  // log2 units; l over this lane's tokens
"""
# the score mma over the dequantized key words w0 / w1 (tokens g, g + 8) with their scales sa / sb and biases za / zb;
KEY_MMA = r"""
#pragma unroll
      for (int i = 0; i < NKB; i++) {
        const int j = i / (PPK / 2), e = i % (PPK / 2), u = NGT > 1 ? (j * EPK) / KG : 0;
        const uint32_t a0 = deq2((w0[j] >> (KB * 2 * e)) & KM2, sa[u], za[u]);
        const uint32_t a1 = deq2((w1[j] >> (KB * 2 * e)) & KM2, sb[u], zb[u]);
        const uint32_t a2 = deq2((w0[j] >> (KB * (2 * e + 1))) & KM2, sa[u], za[u]);
        const uint32_t a3 = deq2((w1[j] >> (KB * (2 * e + 1))) & KM2, sb[u], zb[u]);
        mma16816(i & 1 ? s2 : s, a0, a1, a2, a3, qa[i][0], qa[i][1]);
      }
    }
"""
# the mask, the online softmax of both query vectors, P^T's fragment pb0 / pb1 by four shuffles;
SOFTMAX = r"""
    const int j0 = t0 + g, j1 = t0 + 8 + g;
    const bool lim0 = j0 < t_end, lim1 = j1 < t_end;
    s[0] = real0 && lim0 && j0 >= lo0 + qn0 && j0 < min(hi0 + qn0, cnt) ? s[0] + s2[0] : NEG;
    s[1] = real1 && lim0 && j0 >= lo0 + qn1 && j0 < min(hi0 + qn1, cnt) ? s[1] + s2[1] : NEG;
    s[2] = real0 && lim1 && j1 >= lo0 + qn0 && j1 < min(hi0 + qn0, cnt) ? s[2] + s2[2] : NEG;
    s[3] = real1 && lim1 && j1 >= lo0 + qn1 && j1 < min(hi0 + qn1, cnt) ? s[3] + s2[3] : NEG;
    float x0 = fmaxf(s[0], s[2]), x1 = fmaxf(s[1], s[3]);
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
      x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, o));
      x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, o));
    }
    const float mn0 = fmaxf(m0, x0), mn1 = fmaxf(m1, x1);
    const float cr0 = exp2f(m0 - mn0), cr1 = exp2f(m1 - mn1);
    m0 = mn0;
    m1 = mn1;
    const float p0 = s[0] > 0.5f * NEG ? exp2f(s[0] - mn0) : 0.f, p1 = s[1] > 0.5f * NEG ? exp2f(s[1] - mn1) : 0.f;
    const float p2 = s[2] > 0.5f * NEG ? exp2f(s[2] - mn0) : 0.f, p3 = s[3] > 0.5f * NEG ? exp2f(s[3] - mn1) : 0.f;
    l0 = l0 * cr0 + (p0 + p2);
    l1 = l1 * cr1 + (p1 + p3);
#pragma unroll
    for (int m = 0; m < NMB; m++) { acc[m][0] *= cr0; acc[m][1] *= cr1; acc[m][2] *= cr0; acc[m][3] *= cr1; }
    uint32_t pb0, pb1;
    {
      const uint32_t hA = pack_h2(p0, p1), hB = pack_h2(p2, p3);
      const int src0 = 8 * c + (g >> 1), src1 = src0 + 4;
      const uint32_t sel = (g & 1) ? 0x7632u : 0x5410u;
      const uint32_t x0 = __shfl_sync(0xffffffffu, hA, src0), x1 = __shfl_sync(0xffffffffu, hA, src1);
      const uint32_t y0 = __shfl_sync(0xffffffffu, hB, src0), y1 = __shfl_sync(0xffffffffu, hB, src1);
      pb0 = __byte_perm(x0, x1, sel);
      pb1 = __byte_perm(y0, y1, sel);
    }
"""
# after the loop: the warp's sums per query vector, its max and sum into the scratch (then cuda_mma.MERGE)
PARTIALS = r"""
  float lq0 = l0, lq1 = l1;
#pragma unroll
  for (int o = 4; o < 32; o <<= 1) {
    lq0 += __shfl_xor_sync(0xffffffffu, lq0, o);
    lq1 += __shfl_xor_sync(0xffffffffu, lq1, o);
  }
  float* wm = scratch;              // [NWARP][8]
  float* wl = scratch + NWARP * 8;  // [NWARP][8]
  float* wa = scratch + NWARP * 16; // [NWARP][QVB][DV]
  if (g == 0 && real0) { wm[warp * 8 + n0] = m0; wl[warp * 8 + n0] = lq0; }
  if (g == 0 && real1) { wm[warp * 8 + n1] = m1; wl[warp * 8 + n1] = lq1; }
"""

# form 2's loop (after cuda_mma.PRELUDE, before cuda_mma.MERGE): each warp's tiles through its ring, and
# S^T = K Q^T, keys as A (rows g, g + 8: tokens t0 + g, t0 + 8 + g; all 16 rows real), query vectors as B's
# columns: 8 score mma per 16 tokens instead of 16, and no zero rows to rebuild. Lane (g, c) holds the scores of
# tokens (g, g + 8) for query vectors (2c, 2c + 1); P^T's fragment (tokens 2c, 2c + 1, 2c + 8, 2c + 9 for query
# vector g) comes from lanes 8c + g / 2 and 8c + 4 + g / 2 by four shuffles.
LOOP = LANE_QUERIES + r"""  const int tstart = t_begin / 16 * 16 + 16 * warp;  // tokens below lo0 are masked
  const int n_it = tstart < t_end ? (t_end - tstart + 16 * NWARP - 1) / (16 * NWARP) : 0;
  unsigned char* ring = smem + warp * STG * STB;
  const unsigned char* kbase = row_base(kw, 4, kw_strides.data(), b, h);
  const unsigned char* vbase = row_base(vw, 4, vw_strides.data(), b, h + VH);
  const bool kmf = meta_fast<KNG>(ks, ks_strides.data()) && meta_fast<KNG>(kb, kb_strides.data());
  const bool vmf = meta_fast<VNG>(vs, vs_strides.data()) && meta_fast<VNG>(vb, vb_strides.data());
  auto issue = [&](int it) {
    if (it < n_it) {
      const int t0 = tstart + it * 16 * NWARP;
      int pb = b, tp0 = t0;
      if constexpr (PAGED) { pb = ptab[b * PTW + t0 / PAGE]; tp0 = t0 % PAGE; }
      const int last = min(15, t_end - 1 - t0);
      unsigned char* st = ring + (it % STG) * STB;
      const unsigned char* kp = PAGED ? row_base(kw, 4, kw_strides.data(), pb, h) : kbase;
      const unsigned char* vp = PAGED ? row_base(vw, 4, vw_strides.data(), pb, h + VH) : vbase;
      stage_rows<KRW, KRS>(st, kp + tp0 * ktb, ktb, last, lane, kvec);
      stage_rows<VRW, VRS>(st + SOFF_V, vp + tp0 * vtb, vtb, last, lane, vvec);
      stage_meta<KNG>(st + SOFF_KS, ks, ks_strides.data(), pb, h, tp0, last, lane, kmf);
      stage_meta<KNG>(st + SOFF_KZ, kb, kb_strides.data(), pb, h, tp0, last, lane, kmf);
      stage_meta<VNG>(st + SOFF_VS, vs, vs_strides.data(), pb, h + VH, tp0, last, lane, vmf);
      stage_meta<VNG>(st + SOFF_VZ, vb, vb_strides.data(), pb, h + VH, tp0, last, lane, vmf);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int i = 0; i < STG - 1; i++) issue(i);  // in flight while the query fragments load
""" + QUERIES + r"""
  for (int it = 0; it < n_it; it++) {
    const int t0 = tstart + it * 16 * NWARP;
    const unsigned char* st = ring + (it % STG) * STB;
    issue(it + STG - 1);
    cp_async_wait<STG - 1>();
    __syncwarp();
    float s[4] = {0.f, 0.f, 0.f, 0.f}, s2[4] = {0.f, 0.f, 0.f, 0.f};  // even / odd k-blocks: two chains
    {
      uint32_t w0[WTK], w1[WTK];
      load_words<WTK>(w0, st + (g * KRS + WTK * c) * 4, true);
      load_words<WTK>(w1, st + ((8 + g) * KRS + WTK * c) * 4, true);
      const __half* ksm = reinterpret_cast<const __half*>(st + SOFF_KS);
      const __half* kzm = reinterpret_cast<const __half*>(st + SOFF_KZ);
      __half2 sa[NGT], za[NGT], sb[NGT], zb[NGT];
#pragma unroll
      for (int u = 0; u < NGT; u++) {
        const int grp = (KPL * c + u * KG) / KG;
        sa[u] = __half2half2(ksm[g * KNG + grp]);
        za[u] = __half2half2(kzm[g * KNG + grp]);
        sb[u] = __half2half2(ksm[(8 + g) * KNG + grp]);
        zb[u] = __half2half2(kzm[(8 + g) * KNG + grp]);
      }
""" + KEY_MMA + SOFTMAX + r"""    uint32_t vwd[4][WTV];
    __half vsc[4], vbi[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
      const int r = 2 * c + (k & 1) + 8 * (k >> 1), grp = (VPL * g) / VG;
      load_words<WTV>(vwd[k], st + SOFF_V + (r * VRS + WTV * g) * 4, true);
      vsc[k] = reinterpret_cast<const __half*>(st + SOFF_VS)[r * VNG + grp];
      vbi[k] = reinterpret_cast<const __half*>(st + SOFF_VZ)[r * VNG + grp];
    }
""" + VALUES + r"""
    __syncwarp();  // every lane's reads of this stage done before it is refilled
  }
  cp_async_wait<0>();
  __syncthreads();  // the partials below reuse the rings
""" + PARTIALS

BODY = PRELUDE + LOOP + MERGE
