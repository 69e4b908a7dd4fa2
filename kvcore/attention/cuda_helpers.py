"""CUDA device functions the decode kernel (`cuda_source.SOURCE`) inlines: reading elements of packed
token rows, staging tiles and their metadata in shared memory, a row's scores and values, warp reductions.

Element d of a token row (32-bit words, little-endian bit stream) is read as
```
o = d * BITS;  w = o >> 5;  sh = o & 31
code = ((row[w] >> sh) | (sh + BITS > 32 ? row[w + 1] << (32 - sh) : 0)) & (2^BITS - 1)
```
affine: x = scale[g] * code + bias[g] (the dot is taken per group: scale * sum q code + bias * sum q);
turbo: x = codebook[code] * norm (scores in the rotated basis); dense: the bf16/fp16/fp32 bits.
Token t of row b, head h is at `base + b * stride0 + h * stride1 + t * stride2` (the strides of
the arrays as they are, so a one-row slice of a bigger buffer is read in place, never copied);
for paged rows `b` is the tile's page, found in the block table, and `t` its token in the page.
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
