"""TurboQuant K/V in the tensor-core decode body (form 1, `cuda_mma.LOOP`), the CUDA default since run 12
(its device tests pass; 62 us a layer at 32k against the scalar body's 84); `MLXKV_CUDA_TURBO_MMA=0` keeps the
scalar body (~3 500 instructions per token).

A turbo row stores bit-packed codebook indices in the rotated basis (element d at bits
[d * bits, (d + 1) * bits) of the row's little-endian bit stream, bytes) and one fp16 norm per token:
x_d = book[code_d] * norm. Attention is read in the rotated basis (the query is rotated, the
output rotated back, `rotated.py`), so what the body needs is:
- keys: the same fragments as affine keys of these bits (words of token g, element pairs (t, t + PPK)
  of a word), each pair's two codes looked up in the key book (fp16, shared memory): the score mma
  takes centroids, and each score is scaled by its token's norm after the mma (the norm is per token,
  so it factors out of the dot product);
- values: the lane's VPL elements of tokens (2c, 2c + 1, 2c + 8, 2c + 9) read as bytes (3-bit rows
  put a lane's 16 elements at a 6-byte offset: three 16-bit loads), codes looked up in the value
  book; each token's norm is folded into its probability before P^T's fragment is packed (the
  denominator keeps the plain probabilities).
Covered: key bits 2, 4, 8 (whole element pairs per half word, as affine's), value bits 2, 3, 4, 8 with
a lane's value bits a whole number of 16-bit halves (3 bits: value dims a multiple of 128).
"""

from __future__ import annotations

import os

from .cuda_mma import KEY_MMA, KEY_SCALES, LOOP, MERGE, PRELUDE, QUERIES, VALUE_LOADS, VALUES

TURBO_KEY_BITS = (2, 4, 8)
TURBO_VALUE_BITS = (2, 3, 4, 8)


def enabled() -> bool:
    return os.environ.get("MLXKV_CUDA_TURBO_MMA", "1") != "0"


def turbo_fits(key, value) -> bool:
    """Whether the turbo body covers these sides (both turbo: one rotation, read in its basis)."""
    if not (key.kind == value.kind == "turbo") or key.bits not in TURBO_KEY_BITS or value.bits not in TURBO_VALUE_BITS:
        return False
    lane_bits = value.dim // 8 * value.bits  # a lane's elements of one value row
    return key.dim % 64 == 0 and value.dim % 64 == 0 and lane_bits % 16 == 0 and key.dim <= 256 and value.dim <= 256


def book_bytes(key_bits: int, value_bits: int) -> int:
    """Shared memory of the two codebooks (fp16)."""
    return 2 * ((1 << key_bits) + (1 << value_bits))


HEADER = r"""
// two codes (one per 16-bit half) -> half2 of their codebook entries
__device__ __forceinline__ uint32_t lut2(const __half* book, uint32_t codes) {
  __half2 x = __halves2half2(book[codes & 0xffffu], book[codes >> 16]);
  return *reinterpret_cast<uint32_t*>(&x);
}

// code e (compile-time) of a lane's little-endian bit chunk
template <int BITS, int E>
__device__ __forceinline__ uint32_t chunk_code(const uint32_t* w) {
  constexpr int o = E * BITS, j = o >> 5, sh = o & 31;
  uint32_t u = w[j] >> sh;
  if constexpr (sh + BITS > 32) u |= w[j + 1] << (32 - sh);
  return u & ((1u << BITS) - 1u);
}
"""

# the books in shared memory (after the warps' partials): keys' entries, then values'
BOOKS = r"""
  __half* kbook = reinterpret_cast<__half*>(smem + OFF_BOOK);
  __half* vbook = kbook + (1 << KB);
  for (int i = tid; i < (1 << KB); i += THREADS) kbook[i] = __float2half(kcb[i]);
  for (int i = tid; i < (1 << VB); i += THREADS) vbook[i] = __float2half(vcb[i]);
  __syncthreads();
"""

# k-block i's B registers: the pair's codes looked up (no scales: the norm multiplies the score after the mma)
_TURBO_KEY_MMA = r"""        const int j = i / (PPK / 2), e = i % (PPK / 2);
        const uint32_t b0 = lut2(kbook, (w[j] >> (KB * 2 * e)) & KM2);
        const uint32_t b1 = lut2(kbook, (w[j] >> (KB * (2 * e + 1))) & KM2);
"""

# after the n-block's mma: this lane's score columns are tokens t0 + 8 nb + 2c + z, each times its norm
_KEYS_DONE = r"""        mma16816(s[nb], qa[i][0], 0u, qa[i][1], 0u, b0, b1);
      }
"""
_TURBO_KEYS_DONE = _KEYS_DONE + r"""#pragma unroll
      for (int z = 0; z < 2; z++) {
        const int tz = min(t0 + 8 * nb + 2 * c + z, t_end - 1), tpz = PAGED ? tz % PAGE : tz;
        s[nb][z] *= __half2float((ks + (pb * ks_strides[0] + h * ks_strides[1]))[tpz * static_cast<int>(ks_strides[2])]);
      }
"""

_AFFINE_P = r"""    const uint32_t pb0 = pack_h2(p[0][0], p[0][1]), pb1 = pack_h2(p[1][0], p[1][1]);
"""

# tokens t0 + 2c + (k & 1) + 8 (k >> 1) of P^T's fragment are the value tokens this lane reads: their norms
_TURBO_P = r"""    float pv[4] = {p[0][0], p[0][1], p[1][0], p[1][1]};
#pragma unroll
    for (int k = 0; k < 4; k++) {
      const int t = min(t0 + 2 * c + (k & 1) + 8 * (k >> 1), t_end - 1), tp = PAGED ? t % PAGE : t;
      pv[k] *= __half2float((vs + (pbt * vs_strides[0] + (h + VH) * vs_strides[1]))[tp * static_cast<int>(vs_strides[2])]);
    }
    const uint32_t pb0 = pack_h2(pv[0], pv[1]), pb1 = pack_h2(pv[2], pv[3]);
"""

# this lane's VPL codes of tokens t0 + (2c, 2c + 1, 2c + 8, 2c + 9): VPL * VB bits at bit VPL * VB * g of the row
_TURBO_VALUE_LOADS = r"""
    constexpr int VLB = VPL * VB / 8, VLH = VLB / 2, VLW = (VLH + 1) / 2;  // a lane's bytes, halves, words
    uint32_t vx[4][VLW];
#pragma unroll
    for (int k = 0; k < 4; k++) {
      const int t = min(t0 + 2 * c + (k & 1) + 8 * (k >> 1), t_end - 1);
      const int tp = PAGED ? t % PAGE : t;
      const unsigned short* hp = reinterpret_cast<const unsigned short*>(
          row_base(vw, 1, vw_strides.data(), pbt, h + VH) + tp * vtb + VLB * g);
#pragma unroll
      for (int j = 0; j < VLW; j++) {
        const uint32_t lo = hp[2 * j], hi = 2 * j + 1 < VLH ? hp[2 * j + 1] : 0u;
        vx[k][j] = lo | (hi << 16);
      }
    }
"""

_TURBO_VALUES = r"""
    {
#pragma unroll
      for (int m = 0; m < NMB; m++) {
        uint32_t a[4];
        CODE_PAIRS
        mma16816(acc[m], a[0], a[1], a[2], a[3], pb0, pb1);
      }
    }
"""


def _code_pairs(nmb: int) -> str:
    """The A fragment of m-block m: a[r] = (token 2 (r >> 1), token 2 (r >> 1) + 1) at element (r & 1) NMB + m,
    written out per m so the element index is a compile-time constant (`chunk_code`'s template argument)."""
    lines = []
    for m in range(nmb):
        lines.append(f"if (m == {m}) {{")
        for r in range(4):
            e = (r & 1) * nmb + m
            ka, kb_ = 2 * (r >> 1), 2 * (r >> 1) + 1
            lines.append(f"  a[{r}] = lut2(vbook, chunk_code<VB, {e}>(vx[{ka}]) | (chunk_code<VB, {e}>(vx[{kb_}]) << 16));")
        lines.append("}")
    return "\n        ".join(lines)


def loop(value_dim: int) -> str:
    """Form 1's loop with turbo keys and values (the NMB = value_dim / 16 m-blocks spelled out)."""
    text = LOOP
    for old, new in ((KEY_SCALES, ""), (KEY_MMA, _TURBO_KEY_MMA), (_KEYS_DONE, _TURBO_KEYS_DONE), (_AFFINE_P, _TURBO_P),
                     (VALUE_LOADS, _TURBO_VALUE_LOADS),
                     (VALUES, _TURBO_VALUES.replace("CODE_PAIRS", _code_pairs(value_dim // 16)))):
        assert text.count(old) == 1, old[:60]
        text = text.replace(old, new)
    assert text.count("row_base(kw, 4,") == 1
    return text.replace("row_base(kw, 4,", "row_base(kw, 1,")


def prelude() -> str:
    """cuda_mma.PRELUDE for byte rows (turbo arrays are uint8: strides count bytes), then the books."""
    text = PRELUDE
    for side in ("kw", "vw"):
        for old in (f"static_cast<int>({side}_strides[2] * 4ll)", f"({side}_strides[0] * 4ull) | ({side}_strides[1] * 4ull)"):
            assert text.count(old) == 1, old
            text = text.replace(old, old.replace("* 4", "* 1"))
    return text + BOOKS


def body(value_dim: int) -> str:
    return prelude() + QUERIES + loop(value_dim) + MERGE
