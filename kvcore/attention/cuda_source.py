"""CUDA text of the decode kernel and its split merge (for `mx.fast.cuda_kernel`).

Compile-time constants come from `cuda_launch.Plan.template`; runtime inputs are the
per-row token bounds `rows` (B, 3) = (lo0, hi0, count), `dims` = (chunk, nsplit) and the
softmax scale, so the kernel compiles once per plan and never as the context grows.

Element d of a token row (32-bit words, little-endian bit stream) is read as
```
o = d * BITS;  w = o >> 5;  sh = o & 31
code = ((row[w] >> sh) | (sh + BITS > 32 ? row[w + 1] << (32 - sh) : 0)) & (2^BITS - 1)
```
affine: x = scale[g] * code + bias[g] (the dot is taken per group: scale * sum q code + bias * sum q);
turbo: x = codebook[code] * norm (scores in the rotated basis); dense: the bf16/fp16/fp32 bits.
Token t of row b, head h is at `base + b * stride0 + h * stride1 + t * stride2` (the strides of
the arrays as they are, so a one-row slice of a bigger buffer is read in place, never copied;
a block table would replace this one address computation, `row_base`).
"""

HEADER = r"""
__device__ __forceinline__ float code_float(uint32_t c) {
  return __uint_as_float(0x4B000000u | c) - 8388608.f;  // exact for c < 2^23, no int->float convert
}

template <int KIND, int BITS, int DT>
__device__ __forceinline__ float elem(const uint32_t* row, int d, const float* cb) {
  constexpr uint32_t MASK = BITS == 32 ? 0xffffffffu : ((1u << (BITS % 32)) - 1u);
  const int o = d * BITS, w = o >> 5, sh = o & 31;
  uint32_t u = row[w] >> sh;
  if (BITS < 32 && sh + BITS > 32) u |= row[w + 1] << ((32 - sh) & 31);
  u &= MASK;
  if constexpr (KIND == 0) {
    if constexpr (DT == 2) return __uint_as_float(u);
    else if constexpr (DT == 0) return __uint_as_float(u << 16);
    else return __half2float(__ushort_as_half((unsigned short)u));
  } else if constexpr (KIND == 1) {
    return code_float(u);
  } else {
    return cb[u];
  }
}

__device__ __forceinline__ const unsigned char* row_base(const void* p, int esize, const int64_t* st, int b, int h) {
  return reinterpret_cast<const unsigned char*>(p) + (b * st[0] + h * st[1]) * (long long)esize;
}

template <int RW, int TT, int THREADS>
__device__ __forceinline__ void load_rows(uint32_t* dst, const unsigned char* base, long long tok_bytes,
                                          int t0, int nt, int tid) {
  constexpr int RP = RW + 1;  // one pad word per row: a thread per token reads without bank conflicts
  bool vec = false;
  if constexpr (RW % 4 == 0) {
    vec = (tok_bytes % 16 == 0) && ((reinterpret_cast<unsigned long long>(base) + t0 * tok_bytes) % 16 == 0);
  }
  if constexpr (RW % 4 == 0) {
    if (vec) {
      constexpr int R4 = RW / 4;
#pragma unroll 4
      for (int i = tid; i < TT * R4; i += THREADS) {
        const int t = i / R4, w = (i % R4) * 4;
        uint4 x = make_uint4(0u, 0u, 0u, 0u);
        if (t < nt) x = *reinterpret_cast<const uint4*>(base + (long long)(t0 + t) * tok_bytes + w * 4);
        uint32_t* o = dst + t * RP + w;
        o[0] = x.x; o[1] = x.y; o[2] = x.z; o[3] = x.w;
      }
      return;
    }
  }
#pragma unroll 4
  for (int i = tid; i < TT * RW; i += THREADS) {
    const int t = i / RW, w = i % RW;
    dst[t * RP + w] = t < nt ? *reinterpret_cast<const uint32_t*>(base + (long long)(t0 + t) * tok_bytes + w * 4) : 0u;
  }
}

template <int KIND, int NG, int MS, int TT, int THREADS>
__device__ __forceinline__ void load_meta(float* dst, const __half* s, const __half* z, const int64_t* ss,
                                          const int64_t* zs, int b, int h, int t0, int nt, int tid) {
  if constexpr (KIND == 1) {
    for (int i = tid; i < TT * NG; i += THREADS) {
      const int t = i / NG, g = i % NG;
      float a = 0.f, c = 0.f;
      if (t < nt) {
        a = __half2float(s[b * ss[0] + h * ss[1] + (long long)(t0 + t) * ss[2] + g * ss[3]]);
        c = __half2float(z[b * zs[0] + h * zs[1] + (long long)(t0 + t) * zs[2] + g * zs[3]]);
      }
      dst[t * MS + g] = a;
      dst[TT * MS + t * MS + g] = c;
    }
  } else if constexpr (KIND == 2) {
    for (int t = tid; t < TT; t += THREADS)
      dst[t] = t < nt ? __half2float(s[b * ss[0] + h * ss[1] + (long long)(t0 + t) * ss[2]]) : 0.f;
  }
}

// scores of one token row against QVB query vectors (qs: [D][QVP], qsum: [NG][QVP])
template <int KIND, int BITS, int DT, int D, int G, int NG, int QVB, int QVP, int TT, int MS>
__device__ __forceinline__ void score_row(float* s, const uint32_t* row, const float* meta, const float* qs,
                                          const float* qsum, const float* cb) {
#pragma unroll
  for (int v = 0; v < QVB; v++) s[v] = 0.f;
#pragma unroll
  for (int g = 0; g < NG; g++) {
    float ga[QVP];
#pragma unroll
    for (int v = 0; v < QVP; v++) ga[v] = 0.f;
#pragma unroll
    for (int e = 0; e < G; e++) {
      const int d = g * G + e;
      const float x = elem<KIND, BITS, DT>(row, d, cb);
      const float4* q4 = reinterpret_cast<const float4*>(qs + d * QVP);
#pragma unroll
      for (int c = 0; c < QVP / 4; c++) {
        const float4 qq = q4[c];
        ga[4 * c + 0] = fmaf(qq.x, x, ga[4 * c + 0]);
        ga[4 * c + 1] = fmaf(qq.y, x, ga[4 * c + 1]);
        ga[4 * c + 2] = fmaf(qq.z, x, ga[4 * c + 2]);
        ga[4 * c + 3] = fmaf(qq.w, x, ga[4 * c + 3]);
      }
    }
    if constexpr (KIND == 1) {
      const float sc = meta[g], bi = meta[TT * MS + g];
#pragma unroll
      for (int v = 0; v < QVB; v++) s[v] += sc * ga[v] + bi * qsum[g * QVP + v];
    } else {
#pragma unroll
      for (int v = 0; v < QVB; v++) s[v] += ga[v];
    }
  }
  if constexpr (KIND == 2) {
#pragma unroll
    for (int v = 0; v < QVB; v++) s[v] *= meta[0];
  }
}

// VE consecutive value elements [c * VE, c * VE + VE) of one token row
template <int KIND, int BITS, int DT, int G, int VE, int TT, int MS>
__device__ __forceinline__ void value_chunk(float* x, const uint32_t* row, const float* meta, int c, const float* cb) {
  if constexpr ((VE * BITS) % 32 == 0) {
    const uint32_t* r = row + c * (VE * BITS / 32);  // the chunk starts on a word: offsets known at compile time
#pragma unroll
    for (int e = 0; e < VE; e++) x[e] = elem<KIND, BITS, DT>(r, e, cb);
  } else {
#pragma unroll
    for (int e = 0; e < VE; e++) x[e] = elem<KIND, BITS, DT>(row, c * VE + e, cb);
  }
  if constexpr (KIND == 1) {
    const int g = (c * VE) / G;
    const float sc = meta[g], bi = meta[TT * MS + g];
#pragma unroll
    for (int e = 0; e < VE; e++) x[e] = fmaf(sc, x[e], bi);
  } else if constexpr (KIND == 2) {
#pragma unroll
    for (int e = 0; e < VE; e++) x[e] *= meta[0];
  }
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
"""

INPUTS = ["q", "kw", "ks", "kb", "vw", "vs", "vb", "kcb", "vcb", "rows", "dims", "fscale", "ctr", "slot", "sinks",
          "ptab"]
OUTPUTS = ["m_out", "l_out", "acc_out", "out"]

# grid (nsplit * NQC * THREADS, Hkv, B); block (THREADS): one (split, query chunk, KV head, row).
# dims = (chunk, nsplit, value head offset); slot = the counters' base. With FUSED, the block that finishes a
# (row, KV head, query chunk) last merges its splits into `out` (flash decoding in one launch):
# every block counts itself in ctr[slot + (b * Hkv + h) * NQC + qc] after its partials are written
# and fenced; the one that sees nsplit - 1 merges and sets the counter back to 0 for the next launch.
SOURCE = r"""
  constexpr int QVT = REP * NQ;
  constexpr int NWARP = THREADS / 32;
  constexpr float NEG = -1e30f;
  extern __shared__ __align__(16) unsigned char smem[];
  float* qs = reinterpret_cast<float*>(smem + OFF_Q);        // [D][QVP] scaled queries
  float* qsum = reinterpret_cast<float*>(smem + OFF_QSUM);   // [KNG][QVP] per-group sums (affine keys)
  float* kcbs = reinterpret_cast<float*>(smem + OFF_KCB);    // codebooks (turbo)
  float* vcbs = reinterpret_cast<float*>(smem + OFF_VCB);
  float* red = reinterpret_cast<float*>(smem + OFF_RED);     // [NWARP][QVP]
  float* ps = reinterpret_cast<float*>(smem + OFF_P);        // [TT][QVP] probabilities of the tile
  uint32_t* kt = reinterpret_cast<uint32_t*>(smem + OFF_KT); // [TT][KRW + 1]
  float* km = reinterpret_cast<float*>(smem + OFF_KM);       // scales [TT][KMS], then biases
  uint32_t* vt = reinterpret_cast<uint32_t*>(smem + OFF_VT);
  float* vm = reinterpret_cast<float*>(smem + OFF_VM);
  float* scratch = reinterpret_cast<float*>(smem + OFF_KT);  // after the last tile: [TS][QVB][DV]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int qc = blockIdx.x % NQC, split = blockIdx.x / NQC, h = blockIdx.y, b = blockIdx.z;
  const int CHUNK = dims[0], NSPLIT = dims[1], VH = dims[2], PTW = dims[3];
  const int lo0 = rows[3 * b], hi0 = rows[3 * b + 1], cnt = rows[3 * b + 2];
  // paged: tiles start on tile boundaries, so none straddles a page (PAGE is a multiple of TT); the mask drops the rest
  const int t_begin = PAGED ? max(split * CHUNK, max(lo0, 0)) / TT * TT : max(split * CHUNK, max(lo0, 0));
  const int t_end = min(split * CHUNK + CHUNK, min(hi0 + NQ - 1, cnt));
  const float scale = fscale[0];

  for (int i = tid; i < D * QVP; i += THREADS) {
    const int d = i / QVP, vl = i % QVP, v = qc * QVB + vl;
    float x = 0.f;
    if (vl < QVB) {
      const int r = v / NQ, n = v % NQ;
      x = static_cast<float>(q[b * q_strides[0] + (h * REP + r) * q_strides[1] + n * q_strides[2] +
                               d * q_strides[3]]) * scale;
    }
    qs[i] = x;
  }
  if constexpr (KK == 2) { for (int i = tid; i < (1 << KB); i += THREADS) kcbs[i] = kcb[i]; }
  if constexpr (VK == 2) { for (int i = tid; i < (1 << VB); i += THREADS) vcbs[i] = vcb[i]; }
  __syncthreads();
  if constexpr (KK == 1) {
    for (int i = tid; i < KNG * QVP; i += THREADS) {
      const int g = i / QVP, vl = i % QVP;
      float a = 0.f;
      for (int e = 0; e < KG; e++) a += qs[(g * KG + e) * QVP + vl];
      qsum[i] = a;
    }
  }

  float m_run[QVB], l_part[QVB], acc[QVB][VE];
#pragma unroll
  for (int v = 0; v < QVB; v++) {
    m_run[v] = NEG;
    l_part[v] = 0.f;
#pragma unroll
    for (int e = 0; e < VE; e++) acc[v][e] = 0.f;
  }
  const int vc = tid % TPR, vts = tid / TPR;
  const unsigned char* kbase = row_base(kw, sizeof(*kw), kw_strides.data(), b, h);
  const unsigned char* vbase = row_base(vw, sizeof(*vw), vw_strides.data(), b, h + VH);
  const long long ktb = kw_strides[2] * (long long)sizeof(*kw), vtb = vw_strides[2] * (long long)sizeof(*vw);

  for (int t0 = t_begin; t0 < t_end; t0 += TT) {
    const int nt = min(TT, t_end - t0);
    int pb = b, pt0 = t0;  // paged: the tile's page (the block table) and its first token in it
    if constexpr (PAGED) { pb = ptab[b * PTW + t0 / PAGE]; pt0 = t0 % PAGE; }
    const unsigned char* kpage = PAGED ? row_base(kw, sizeof(*kw), kw_strides.data(), pb, h) : kbase;
    const unsigned char* vpage = PAGED ? row_base(vw, sizeof(*vw), vw_strides.data(), pb, h + VH) : vbase;
    load_rows<KRW, TT, THREADS>(kt, kpage, ktb, pt0, nt, tid);
    load_rows<VRW, TT, THREADS>(vt, vpage, vtb, pt0, nt, tid);
    load_meta<KK, KNG, KMS, TT, THREADS>(km, ks, kb, ks_strides.data(), kb_strides.data(), pb, h, pt0, nt, tid);
    load_meta<VK, VNG, VMS, TT, THREADS>(vm, vs, vb, vs_strides.data(), vb_strides.data(), pb, h + VH, pt0, nt, tid);
    __syncthreads();

    // scores: one token per thread, every query vector of the block
    float s[QVB];
    if (tid < TT) {
      score_row<KK, KB, KDT, D, KG, KNG, QVB, QVP, TT, KMS>(s, kt + tid * (KRW + 1), km + tid * KMS, qs, qsum, kcbs);
    }
    const int j = t0 + tid;
#pragma unroll
    for (int v = 0; v < QVB; v++) {
      const int n = (qc * QVB + v) % NQ;
      const bool ok = tid < nt && j >= lo0 + n && j < min(hi0 + n, cnt);
      s[v] = ok ? s[v] : NEG;
      const float wm = warp_max(s[v]);
      if (lane == 0) red[warp * QVP + v] = wm;
    }
    __syncthreads();

    // online softmax over tiles: new running max, rescale, probabilities of this tile
    float corr[QVB];
#pragma unroll
    for (int v = 0; v < QVB; v++) {
      float tm = red[v];
#pragma unroll
      for (int w = 1; w < NWARP; w++) tm = fmaxf(tm, red[w * QVP + v]);
      const float mn = fmaxf(m_run[v], tm);
      corr[v] = __expf(m_run[v] - mn);
      m_run[v] = mn;
      const float p = s[v] > 0.5f * NEG ? __expf(s[v] - mn) : 0.f;
      if (tid < TT) ps[tid * QVP + v] = p;
      l_part[v] = l_part[v] * corr[v] + p;
    }
    __syncthreads();

    // weighted values: VE channels per thread, tokens vts, vts + TS, ...
#pragma unroll
    for (int v = 0; v < QVB; v++) {
#pragma unroll
      for (int e = 0; e < VE; e++) acc[v][e] *= corr[v];
    }
    for (int t = vts; t < nt; t += TS) {
      float x[VE];
      value_chunk<VK, VB, VDT, VG, VE, TT, VMS>(x, vt + t * (VRW + 1), vm + t * VMS, vc, vcbs);
      const float4* p4 = reinterpret_cast<const float4*>(ps + t * QVP);
      float p[QVP];
#pragma unroll
      for (int c = 0; c < QVP / 4; c++) {
        const float4 pp = p4[c];
        p[4 * c] = pp.x; p[4 * c + 1] = pp.y; p[4 * c + 2] = pp.z; p[4 * c + 3] = pp.w;
      }
#pragma unroll
      for (int v = 0; v < QVB; v++) {
#pragma unroll
        for (int e = 0; e < VE; e++) acc[v][e] = fmaf(p[v], x[e], acc[v][e]);
      }
    }
    __syncthreads();
  }

  // partials of this split: m, l (sum over threads), acc (sum over token subsets)
#pragma unroll
  for (int v = 0; v < QVB; v++) {
    const float ws = warp_sum(l_part[v]);
    if (lane == 0) red[warp * QVP + v] = ws;
  }
#pragma unroll
  for (int v = 0; v < QVB; v++) {
#pragma unroll
    for (int e = 0; e < VE; e++) scratch[(vts * QVB + v) * DV + vc * VE + e] = acc[v][e];
  }
  __syncthreads();
  const long long ob = ((long long)(b * gridDim.y + h) * NSPLIT + split) * QVT + qc * QVB;
  if (tid < QVB) {
    float lt = 0.f, mv = NEG;
    for (int w = 0; w < NWARP; w++) lt += red[w * QVP + tid];
#pragma unroll
    for (int v = 0; v < QVB; v++) mv = (v == tid) ? m_run[v] : mv;
    m_out[ob + tid] = mv;
    l_out[ob + tid] = lt;
  }
  for (int i = tid; i < QVB * DV; i += THREADS) {
    const int v = i / DV, d = i % DV;
    float a = 0.f;
#pragma unroll
    for (int u = 0; u < TS; u++) a += scratch[(u * QVB + v) * DV + d];
    acc_out[(ob + v) * DV + d] = a;
  }
  if constexpr (FUSED) {
    __shared__ int last;
    __threadfence();
    __syncthreads();
    int* counter = const_cast<int*>(ctr) + slot[0] + (b * gridDim.y + h) * NQC + qc;
    if (tid == 0) last = atomicAdd(counter, 1) == NSPLIT - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    // the merge, all threads: a warp per query vector for the splits' weights and the denominator,
    // then four output channels per thread (float4 reads of the partial outputs across splits)
    const long long base = (long long)(b * gridDim.y + h) * NSPLIT * QVT;
    const int HQ = gridDim.y * REP;
    float* ws = scratch;                   // [QVB][NSPLIT] weights e^(m_s - M)
    float* dens = scratch + QVB * NSPLIT;  // [QVB]
    for (int vl = warp; vl < QVB; vl += NWARP) {
      const int v = qc * QVB + vl;
      float M = NEG;
      for (int s = lane; s < NSPLIT; s += 32) M = fmaxf(M, __ldcg(m_out + base + (long long)s * QVT + v));
      M = warp_max(M);
      float sk = 0.f;
      if constexpr (HAS_SINK) { sk = sinks[h * REP + v / NQ]; M = fmaxf(M, sk); }
      float den = 0.f;
      for (int s = lane; s < NSPLIT; s += 32) {
        const long long o = base + (long long)s * QVT + v;
        const float w = __expf(__ldcg(m_out + o) - M);
        ws[vl * NSPLIT + s] = w;
        den = fmaf(w, __ldcg(l_out + o), den);
      }
      den = warp_sum(den);
      if (lane == 0) dens[vl] = HAS_SINK ? den + __expf(sk - M) : den;
    }
    __syncthreads();
    constexpr int D4 = DV / 4;
    for (int i = tid; i < QVB * D4; i += THREADS) {
      const int vl = i / D4, d4 = i % D4, v = qc * QVB + vl, hq = h * REP + v / NQ, n = v % NQ;
      const float* wv = ws + vl * NSPLIT;
      float4 num = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
      for (int s = 0; s < NSPLIT; s++) {
        const float w = wv[s];
        const float4 a = __ldcg(reinterpret_cast<const float4*>(acc_out + (base + (long long)s * QVT + v) * DV) + d4);
        num.x = fmaf(w, a.x, num.x); num.y = fmaf(w, a.y, num.y);
        num.z = fmaf(w, a.z, num.z); num.w = fmaf(w, a.w, num.w);
      }
      const float den = dens[vl];
      OT* o = out + (((long long)b * HQ + hq) * NQ + n) * DV + d4 * 4;
      o[0] = static_cast<OT>(den > 0.f ? num.x / den : 0.f);
      o[1] = static_cast<OT>(den > 0.f ? num.y / den : 0.f);
      o[2] = static_cast<OT>(den > 0.f ? num.z / den : 0.f);
      o[3] = static_cast<OT>(den > 0.f ? num.w / den : 0.f);
    }
    if (tid == 0) *counter = 0;
  }
"""

MERGE_INPUTS = ["m", "l", "acc", "sinks", "dims"]
MERGE_OUTPUTS = ["out"]

# grid (DV, Hq * NQ, B); block (DV): one (row, query head, query), a thread per output channel
#   out = sum_s e^(m_s - M) acc_s / (sum_s e^(m_s - M) l_s + e^(sink - M))
MERGE_SOURCE = r"""
  constexpr int QVT = REP * NQ;
  const int d = threadIdx.x, hq = blockIdx.y / NQ, n = blockIdx.y % NQ, b = blockIdx.z;
  const int HQ = gridDim.y / NQ, HKV = HQ / REP;
  const int h = hq / REP, r = hq % REP, v = r * NQ + n;
  const int S = dims[1];
  const long long base = (long long)(b * HKV + h) * S * QVT + v;
  float M = -1e30f;
  for (int s = 0; s < S; s++) M = fmaxf(M, m[base + (long long)s * QVT]);
  float sink = 0.f;
  if constexpr (HAS_SINK) { sink = sinks[hq]; M = fmaxf(M, sink); }
  float den = HAS_SINK ? __expf(sink - M) : 0.f, num = 0.f;
  for (int s = 0; s < S; s++) {
    const long long o = base + (long long)s * QVT;
    const float w = __expf(m[o] - M);
    den = fmaf(w, l[o], den);
    num = fmaf(w, acc[o * DV + d], num);
  }
  out[(((long long)b * HQ + hq) * NQ + n) * DV + d] = static_cast<OT>(den > 0.f ? num / den : 0.f);
"""


def compact(text: str) -> str:
    """The text without comments, indentation or blank lines: MLX rebuilds and hashes the kernel
    source on every call, so a shorter one costs less host time per launch."""
    lines = []
    for line in text.splitlines():
        code = line.split("//", 1)[0].strip()
        if code:
            lines.append(code)
    return "\n".join(lines) + "\n"
