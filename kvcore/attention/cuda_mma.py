"""The decode kernel's tensor-core body (`mma.sync.m16n8k16`, fp16 in, fp32 accumulate) for affine K
and V of 2, 4 or 8 bits: the scalar body (`cuda_source.SCALAR_BODY`) spends ~3 500 instructions per
token (one thread per token, every query vector's dot product on CUDA cores); this one dequantizes
packed codes straight into mma fragments (~25 instructions per token and warp) and reads K/V from
global memory into registers, no shared-memory tiles. Same inputs, outputs, grid and partials as the
scalar body, so the split merge (`cuda_source.TAIL`, or the merge launch) serves both.

Per warp, 16 tokens at a time (the block's 4 warps interleave), for one (row, KV head, split):
```
S (16 query rows x 8 tokens) = Q (16 x D) . K^T      two n-blocks of 8 tokens, D/16 k-blocks each
O^T (DV x 8 query vectors) += V^T (DV x 16 tokens) . P^T
```
Query vector v = r * NQ + n sits in row / column v (< 8; rows 8..15 of Q are zero). Lane (g, c) =
(lane / 4, lane % 4). Dims are permuted so each lane dequantizes whole words it loads itself; the
query fragments follow the same permutation, and the output is written back in natural order:
- K: lane (g, c) reads words [WTK c, WTK c + WTK) of token g of each n-block (WTK = words / 4). Word
  j's element pairs (t, t + PPK) (PPK = 16 / bits) are half2 `(w >> bits t) & mask2 | 0x6400`, - 1024
  (exact codes), then * scale + bias (fp16). k-block i = word i / (PPK / 2), pairs 2e, 2e + 1
  (e = i % (PPK / 2)) as the B fragment's two registers.
- V: lane (g, c) reads words [WTV g, WTV g + WTV) (WTV = words / 8) of tokens 2c, 2c + 1, 2c + 8,
  2c + 9; its element q (< DV / 8) is dim (DV / 8) g + q; m-block m's rows g and g + 8 are its
  elements m and DV / 16 + m, two tokens' codes joined in one half2 by a byte permute.
- Softmax in log2 units (q is scaled by scale * log2 e), the partial max written back in natural units.
Forms (`variant`): 1 this one; 2 the staged form (`cuda_stage`: S^T = K Q^T, keys as A, tiles in a
shared-memory ring); 3 (`cuda_form3`, the default where it covers since run 19: `form_for`) form 2's S^T arithmetic with this
form's loads into registers, and this form's shared memory and launch bounds.
"""

from __future__ import annotations

import os

MMA_BITS = (2, 4, 8)  # codes that pack a whole number of element pairs into each half of a word


def variant() -> int | None:
    """MLXKV_CUDA_MMA as set: 0 the scalar body everywhere; 1 the tensor-core body where it fits, K/V read into
    registers, S = Q K^T; 2 its staged form (`cuda_stage`: each warp's tiles in a shared-memory ring filled by
    cp.async, keys as the mma's A operand); 3 (`cuda_form3`) form 2's arithmetic (S^T = K Q^T, no zero-padded
    query fragment) with form 1's loads into registers, shared memory and launch bounds; 4 (`cuda_ring`) form 3's
    lean loop fed by form 2's ring where a launch's arrays suit it. None when unset (or not a form): `form_for`
    picks per sides."""
    v = os.environ.get("MLXKV_CUDA_MMA")
    return int(v) if v in ("0", "1", "2", "3", "4") else None


DEFAULT_FORM = 3  # affine sides whose codes pair within half-words; run 19 (ncu, 4-bit, llama-8b attention): form 3
# 33.9 / 54.3 / 94.7 us at 32k / 64k / 128k against form 1's 34.6 / 55.8 / 98.0 (form 2: 35.2 / 55.3 / 90.4)


def form_for(key, value) -> int:
    """The tensor-core form these sides run: MLXKV_CUDA_MMA where set; else form 3 for affine sides whose codes
    pair within half-words (`word_fits`), form 1 for the rest (turbo and code-chunk bodies are form 1's alone)."""
    v = variant()
    if v is not None:
        return v
    if key.kind == value.kind == "turbo":
        from . import cuda_turbo3

        return 3 if cuda_turbo3.enabled() else 1  # MLXKV_CUDA_TURBO_FORM=3: turbo in form 3's lean loop (opt-in)
    return DEFAULT_FORM if key.kind == value.kind == "affine" and word_fits(key, value) else 1


def mma_fits(key, value, rep: int, n_queries: int, q_dtype: str) -> bool:
    """Whether the tensor-core body covers these sides (cuda_launch.Side) and queries."""
    turbo = "turbo" in (key.kind, value.kind)
    form = form_for(key, value)
    # float32 queries: turbo's alone (the rotated query of a steady step, cuda_decode._rotated_launch), whose codes
    # are centroids of 2-8 bits: fp16 fragments lose nothing they hold (the device check admits at fp16's bound)
    if form == 0 or q_dtype not in ("bfloat16", "float16", *(("float32",) if turbo else ())):
        return False
    if turbo:  # form 1 (cuda_turbo_mma.py; MLXKV_CUDA_TURBO_MMA=0: the scalar body), or form 3 (cuda_turbo3.py, opt-in)
        from . import cuda_turbo_mma

        return (form == 1 or (form == 3 and turbo_form3())) and cuda_turbo_mma.enabled() and rep * n_queries <= 8 \
            and cuda_turbo_mma.turbo_fits(key, value)
    if key.kind != "affine" or value.kind != "affine" or rep * n_queries > 8:
        return False
    if word_fits(key, value):
        return True
    from . import cuda_chunk_mma  # codes that do not pair within half-words (cuda_chunk_mma.py)

    return form == 1 and cuda_chunk_mma.enabled() and cuda_chunk_mma.chunk_fits(key, value)


def turbo_form3() -> bool:
    from . import cuda_turbo3

    return cuda_turbo3.enabled()


def word_fits(key, value) -> bool:
    """Whether form 1's word arrangement covers these affine sides: codes pair within 16-bit halves."""
    if key.bits not in MMA_BITS or value.bits not in MMA_BITS or key.dim % 64 or value.dim % 64:
        return False
    k_per_lane, v_per_lane = key.dim // 4, value.dim // 8  # dims one lane dequantizes per token
    k_groups_ok = (key.group % k_per_lane == 0 or k_per_lane % key.group == 0) and key.group % (32 // key.bits) == 0
    whole_v_words = value.words % 8 == 0  # a lane's V elements fill whole words (not 2-bit codes of 64 dims)
    return k_groups_ok and whole_v_words and value.group % v_per_lane == 0 and key.dim <= 256 and value.dim <= 256


def mma_smem(qvb: int, value_dim: int, warps: int) -> int:
    """Shared memory of the tensor-core body's block merge: each warp's partial (max, sum, outputs)."""
    return warps * (16 + qvb * value_dim) * 4


MMA_TILE = 64  # tokens per block round: 4 warps x 16
MIN_BLOCKS = int(os.environ.get("MLXKV_CUDA_MIN_BLOCKS", "4"))  # blocks of 128 threads resident per SM: 4 caps
# registers at 128 a thread (2 for 256-dim values, whose 64 accumulator registers alone would spill under that
# cap); MLXKV_CUDA_MIN_BLOCKS is for the device A/B of more warps against fewer registers

# MLX's cuda_kernel writes `__global__ void name(` right after the header it is given and takes no launch
# bounds, so the header's last lines give the kernel its bounds through the keyword itself: without them
# NVRTC gives the staged form 133-135 registers and an SM holds 3 blocks, not 4 (a second partial wave).
BOUNDS = """
#undef __global__
#define __global__ __location__(global) __launch_bounds__(128, {blocks})
"""


def min_blocks(value_dim: int) -> int:
    return MIN_BLOCKS if value_dim <= 128 else 2


HEADER = r"""
__device__ __forceinline__ void mma16816(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_h2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// two masked codes (one per 16-bit half) -> half2 of scale * code + bias
__device__ __forceinline__ uint32_t deq2(uint32_t codes, __half2 s, __half2 z) {
  uint32_t u = codes | 0x64006400u;  // fp16 1024 + code, exact below 1024
  __half2 x = *reinterpret_cast<__half2*>(&u);
  x = __hfma2(__hsub2(x, __float2half2_rn(1024.f)), s, z);
  return *reinterpret_cast<uint32_t*>(&x);
}

template <int N>
__device__ __forceinline__ void load_words(uint32_t* dst, const unsigned char* p, bool vec) {
  if constexpr (N % 4 == 0) {
    if (vec) {
#pragma unroll
      for (int k = 0; k < N / 4; k++) {
        const uint4 x = reinterpret_cast<const uint4*>(p)[k];
        dst[4 * k] = x.x; dst[4 * k + 1] = x.y; dst[4 * k + 2] = x.z; dst[4 * k + 3] = x.w;
      }
      return;
    }
  } else if constexpr (N % 2 == 0) {
    if (vec) {
#pragma unroll
      for (int k = 0; k < N / 2; k++) {
        const uint2 x = reinterpret_cast<const uint2*>(p)[k];
        dst[2 * k] = x.x; dst[2 * k + 1] = x.y;
      }
      return;
    }
  }
#pragma unroll
  for (int k = 0; k < N; k++) dst[k] = reinterpret_cast<const uint32_t*>(p)[k];
}
"""

# the part both forms share: constants, the stride checks, the accumulators (then QUERIES, the query fragments)
PRELUDE = r"""
  constexpr int EPK = 32 / KB, PPK = 16 / KB, WTK = KRW / 4, NKB = D / 16;
  constexpr int EPV = 32 / VB, PPV = 16 / VB, WTV = VRW / 8, NMB = DV / 16;
  constexpr int KPL = D / 4, VPL = DV / 8;  // dims per lane of a K row / a V row
  constexpr int NGT = KPL >= KG ? KPL / KG : 1;  // key groups a lane's words span
  constexpr uint32_t KM2 = ((1u << KB) - 1u) * 0x10001u, VM2 = ((1u << VB) - 1u) * 0x10001u;
  constexpr float L2E = 1.4426950408889634f, LN2 = 0.6931471805599453f;
  const int g = lane >> 2, c = lane & 3;
  float* scratch = reinterpret_cast<float*>(smem);

  // a token's bytes and the scales' token / group strides in 32 bits: offsets within a row (or page) are ints
  // (cuda_kernels.token_offsets_fit: a row's tokens span under 2 GiB), its base stays 64-bit
  const int ktb = static_cast<int>(kw_strides[2] * 4ll), vtb = static_cast<int>(vw_strides[2] * 4ll);
  const bool kvec = ((reinterpret_cast<unsigned long long>(kw) | (kw_strides[0] * 4ull) | (kw_strides[1] * 4ull) |
                      (ktb * 1ull)) % 16) == 0;
  const bool vvec = ((reinterpret_cast<unsigned long long>(vw) | (vw_strides[0] * 4ull) | (vw_strides[1] * 4ull) |
                      (vtb * 1ull)) % 16) == 0;
  float acc[NMB][4];  // O^T: dims (g, g + 8) of m-block m x query vectors (2c, 2c + 1)
#pragma unroll
  for (int m = 0; m < NMB; m++) { acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = 0.f; }
"""

QUERIES = r"""
  // query fragments: query vector qc * QVB + g, this lane's dims of k-block i (A rows of S = Q K^T in form 1,
  // B columns of S^T = K Q^T in form 2: the same two registers)
  uint32_t qa[NKB][2];
  {
    const int v = qc * QVB + min(g, QVB - 1);
    const long long qo = b * q_strides[0] + (h * REP + v / NQ) * q_strides[1] + (v % NQ) * q_strides[2];
    const float sc = g < QVB ? scale * L2E : 0.f;
#pragma unroll
    for (int i = 0; i < NKB; i++) {
      const int d0 = EPK * (WTK * c + i / (PPK / 2)) + 2 * (i % (PPK / 2));
      qa[i][0] = pack_h2(static_cast<float>(q[qo + d0 * q_strides[3]]) * sc,
                         static_cast<float>(q[qo + (d0 + PPK) * q_strides[3]]) * sc);
      qa[i][1] = pack_h2(static_cast<float>(q[qo + (d0 + 1) * q_strides[3]]) * sc,
                         static_cast<float>(q[qo + (d0 + 1 + PPK) * q_strides[3]]) * sc);
    }
  }
"""

# the pieces of form 1's loop that read and dequantize words (the turbo and code-chunk bodies swap them out:
# cuda_turbo_mma.py, cuda_chunk_mma.py): this lane's key words of token g, their groups' scales and biases,
# k-block i's two B registers, its value words of one token and the A fragment's registers of m-block m
KEY_LOAD = r"""      uint32_t w[WTK];
      load_words<WTK>(w, row_base(kw, 4, kw_strides.data(), pb, h) + tp * ktb + 4 * WTK * c, kvec);
"""
KEY_SCALES = r"""      const __half* ksr = ks + (pb * ks_strides[0] + h * ks_strides[1]);
      const __half* kbr = kb + (pb * kb_strides[0] + h * kb_strides[1]);
      const int mo = tp * static_cast<int>(ks_strides[2]), zo = tp * static_cast<int>(kb_strides[2]);
      __half2 s2[NGT], z2[NGT];
#pragma unroll
      for (int u = 0; u < NGT; u++) {
        const int grp = (KPL * c + u * KG) / KG;
        s2[u] = __half2half2(ksr[mo + grp * static_cast<int>(ks_strides[3])]);
        z2[u] = __half2half2(kbr[zo + grp * static_cast<int>(kb_strides[3])]);
      }
"""
KEY_MMA = r"""        const int j = i / (PPK / 2), e = i % (PPK / 2), u = NGT > 1 ? (j * EPK) / KG : 0;
        const uint32_t b0 = deq2((w[j] >> (KB * 2 * e)) & KM2, s2[u], z2[u]);
        const uint32_t b1 = deq2((w[j] >> (KB * (2 * e + 1))) & KM2, s2[u], z2[u]);
"""
VALUE_DECL = r"""    uint32_t vwd[4][WTV];
"""
VALUE_WORDS = r"""      load_words<WTV>(vwd[k], row_base(vw, 4, vw_strides.data(), pb, h + VH) + tp * vtb + 4 * WTV * g, vvec);
"""
VALUE_PAIRS = r"""#pragma unroll
        for (int r = 0; r < 4; r++) {  // a0a1: (row g, tokens 2c..), a2a3: (row g + 8), a4a5 / a6a7: tokens 2c + 8..
          const int qq = (r & 1) * NMB + m, jw = qq / EPV, e = qq % EPV;
          const uint32_t* wa = vwd[(r >> 1) * 2];
          const uint32_t* wb = vwd[(r >> 1) * 2 + 1];
          const uint32_t x = __byte_perm(wa[jw], wb[jw], e < PPV ? 0x5410 : 0x7632);
          a[r] = deq2((x >> (VB * (e % PPV))) & VM2, r >> 1 ? sB : sA, r >> 1 ? zB : zA);
        }
"""

# O^T += V^T P^T for one 16-token step: this lane's V words of tokens (2c, 2c + 1, 2c + 8, 2c + 9) in vwd,
# their scales and biases in vsc / vbi, P^T's fragment in pb0 / pb1
VALUES = r"""
    {
      const __half2 sA = __halves2half2(vsc[0], vsc[1]), zA = __halves2half2(vbi[0], vbi[1]);
      const __half2 sB = __halves2half2(vsc[2], vsc[3]), zB = __halves2half2(vbi[2], vbi[3]);
#pragma unroll
      for (int m = 0; m < NMB; m++) {
        uint32_t a[4];
""" + VALUE_PAIRS + r"""        mma16816(acc[m], a[0], a[1], a[2], a[3], pb0, pb1);
      }
    }
"""

# after the warp's max and sum per query vector are in wm / wl: its outputs, then the block's 4 warps merged
MERGE = r"""
#pragma unroll
  for (int m = 0; m < NMB; m++) {
#pragma unroll
    for (int z = 0; z < 4; z++) {
      const int v = 2 * c + (z & 1), row = g + 8 * (z >> 1);
      const int d = VPL * (row & 7) + (row >> 3) * NMB + m;
      if (v < QVB) wa[(warp * QVB + v) * DV + d] = acc[m][z];
    }
  }
  __syncthreads();
  const long long ob = ((long long)(b * gridDim.y + h) * NSPLIT + split) * QVT + qc * QVB;
  if (tid < QVB) {
    float M = NEG;
    for (int w = 0; w < NWARP; w++) M = fmaxf(M, wm[w * 8 + tid]);
    float L = 0.f;
    for (int w = 0; w < NWARP; w++) L += exp2f(wm[w * 8 + tid] - M) * wl[w * 8 + tid];
    m_out[ob + tid] = M > 0.5f * NEG ? M * LN2 : NEG;
    l_out[ob + tid] = L;
  }
  for (int i = tid; i < QVB * DV; i += THREADS) {
    const int v = i / DV, d = i % DV;
    float M = NEG;
    for (int w = 0; w < NWARP; w++) M = fmaxf(M, wm[w * 8 + v]);
    float a = 0.f;
    for (int w = 0; w < NWARP; w++) a += exp2f(wm[w * 8 + v] - M) * wa[(w * QVB + v) * DV + d];
    acc_out[(ob + v) * DV + d] = a;
  }
"""

# paged rows: a warp's 16 tokens lie in one page (tiles start on tile boundaries, PAGE a multiple of 16), so the
# tile's page is looked up once, one tile ahead (`pbt` this tile's, `pb_next` the next one's): the block table's
# load is off the loads' critical path. Rows that are not paged read their own row (`pbt` = b).
PAGE_AHEAD = r"""
  int pb_next = b;
  if constexpr (PAGED) { if (t_begin + 16 * warp < t_end) pb_next = ptab[b * PTW + (t_begin + 16 * warp) / PAGE]; }
"""
TILE_PAGE = r"""
    const int pbt = pb_next;
    if constexpr (PAGED) { if (t0 + 16 * NWARP < t_end) pb_next = ptab[b * PTW + (t0 + 16 * NWARP) / PAGE]; }
"""


# this lane's V words of tokens t0 + (2c, 2c + 1, 2c + 8, 2c + 9) and their scales / biases, read from global
# memory (forms 1 and 3), for VALUES
VALUE_LOADS = r"""
    // values of tokens t0 + (2c, 2c + 1, 2c + 8, 2c + 9): this lane's words and scales
""" + VALUE_DECL + r"""    __half vsc[4], vbi[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
      const int t = min(t0 + 2 * c + (k & 1) + 8 * (k >> 1), t_end - 1);
      const int pb = pbt, tp = PAGED ? t % PAGE : t;
""" + VALUE_WORDS + r"""      const int grp = (VPL * g) / VG;
      vsc[k] = (vs + (pb * vs_strides[0] + (h + VH) * vs_strides[1]))[tp * static_cast<int>(vs_strides[2]) +
                                                                   grp * static_cast<int>(vs_strides[3])];
      vbi[k] = (vb + (pb * vb_strides[0] + (h + VH) * vb_strides[1]))[tp * static_cast<int>(vb_strides[2]) +
                                                                   grp * static_cast<int>(vb_strides[3])];
    }
"""

# form 1: K and V read from global memory into registers, S = Q K^T (query vectors as A's rows 0..7)
LOOP = r"""
  const int qn = (qc * QVB + g) % NQ;
  const bool real = g < QVB;
  float m_run = NEG, l_run = 0.f;  // query vector g, log2 units; l over this lane's tokens

""" + PAGE_AHEAD + r"""  for (int t0 = t_begin + 16 * warp; t0 < t_end; t0 += 16 * NWARP) {""" + TILE_PAGE + r"""    // scores of tokens t0 + 8 nb + (2c, 2c + 1) for query vector g
    float s[2][4];
#pragma unroll
    for (int nb = 0; nb < 2; nb++) {
      const int t = min(t0 + 8 * nb + g, t_end - 1);
      const int pb = pbt, tp = PAGED ? t % PAGE : t;
""" + KEY_LOAD + KEY_SCALES + r"""      s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.f;
#pragma unroll
      for (int i = 0; i < NKB; i++) {
""" + KEY_MMA + r"""        mma16816(s[nb], qa[i][0], 0u, qa[i][1], 0u, b0, b1);
      }
    }
    float mx = NEG;
#pragma unroll
    for (int nb = 0; nb < 2; nb++) {
#pragma unroll
      for (int z = 0; z < 2; z++) {
        const int j = t0 + 8 * nb + 2 * c + z;
        const bool ok = real && j < t_end && j >= lo0 + qn && j < min(hi0 + qn, cnt);
        s[nb][z] = ok ? s[nb][z] : NEG;
        mx = fmaxf(mx, s[nb][z]);
      }
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float mn = fmaxf(m_run, mx);
    const float corr = exp2f(m_run - mn);
    m_run = mn;
    float p[2][2], ps = 0.f;
#pragma unroll
    for (int nb = 0; nb < 2; nb++) {
#pragma unroll
      for (int z = 0; z < 2; z++) {
        p[nb][z] = s[nb][z] > 0.5f * NEG ? exp2f(s[nb][z] - mn) : 0.f;
        ps += p[nb][z];
      }
    }
    l_run = l_run * corr + ps;
    const float c0 = __shfl_sync(0xffffffffu, corr, 8 * c), c1 = __shfl_sync(0xffffffffu, corr, 8 * c + 4);
#pragma unroll
    for (int m = 0; m < NMB; m++) { acc[m][0] *= c0; acc[m][1] *= c1; acc[m][2] *= c0; acc[m][3] *= c1; }
    const uint32_t pb0 = pack_h2(p[0][0], p[0][1]), pb1 = pack_h2(p[1][0], p[1][1]);

""" + VALUE_LOADS + VALUES + r"""
  }

  float lq = l_run;
  lq += __shfl_xor_sync(0xffffffffu, lq, 1);
  lq += __shfl_xor_sync(0xffffffffu, lq, 2);
  float* wm = scratch;              // [NWARP][8]
  float* wl = scratch + NWARP * 8;  // [NWARP][8]
  float* wa = scratch + NWARP * 16; // [NWARP][QVB][DV]
  if (c == 0 && real) { wm[warp * 8 + g] = m_run; wl[warp * 8 + g] = lq; }
"""

BODY = PRELUDE + QUERIES + LOOP + MERGE
