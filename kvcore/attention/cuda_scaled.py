"""Form 3 with scaled-code dequantization (`MLXKV_CUDA_DEQ=scaled`, opt-in until checked and timed on the H200).

Form 3 turns each pair of B-bit codes c into fp16 in three instructions and a constant: the codes masked into
the low mantissa bits of 1024 (`(w >> p) & mask | 0x6400`: 1024 + c, exact), 1024 taken off (HADD2: c), then
`c * s + z` (HFMA2). Here the codes are placed at the top of the mantissa of 1.0 instead:

```
x = 0x3C00 | c << (10 - B)  =  1 + c / 2^B   (exact: B <= 10 mantissa bits)
S = 2^B s (exact in fp16), Z = z - S (one fp16 rounding), per token and group, made once per tile
x * S + Z = S + c s + z - S = c s + z        one HFMA2, no HADD2
```
so each pair costs its shift, its mask and one fma: 64 HADD2 fewer per warp and 16 tokens for 4-bit 128-dim
K and V, against one more shift per word (the pair at bit 0 now moves too) and four half2 products per tile
(`cuda_compile_check.py`: 641 -> 612 instructions in form 3's loop; ptxas rebuilds the new mask per use).
Z's rounding adds at most half an ulp of |z| + 2^B |s| to the result's own rounding: about one more fp16 ulp
of the values (the device check admits each plan against the float32 reference at fp16's bound, as for form 3).

The shift moves both 16-bit halves of a word at once; no bit of one half lands in the other's mask (a left
shift by 10 - B - p moves the low half's bits at most to bit 25 - p - B < 26 - B, the high half's mask's
first bit; a right shift by p - 10 + B moves the high half's bits down to at least bit 10, above the low
half's mask), so both halves' codes come out right (tests/test_cuda_scaled.py emulates this bit for bit).
"""

from __future__ import annotations

import os

from . import cuda_form3, cuda_mma, cuda_stage
from .cuda_source import rewrite

HEADER = r"""
// B-bit codes at bit p of both 16-bit halves of w -> half2 of S * (1 + c / 2^B) + Z (cuda_scaled.py)
__device__ __forceinline__ uint32_t deqs(uint32_t w, int B, int p, __half2 S, __half2 Z) {
  const int sh = 10 - B - p;
  const uint32_t placed = sh >= 0 ? (w << sh) : (w >> -sh);
  uint32_t u = (placed & ((((1u << B) - 1u) << (10 - B)) * 0x10001u)) | 0x3C003C00u;
  __half2 x = *reinterpret_cast<__half2*>(&u);
  x = __hfma2(x, S, Z);
  return *reinterpret_cast<uint32_t*>(&x);
}
"""

# form 3's key products (cuda_stage.KEY_MMA): S and Z of both tokens' groups first, then one fma per pair
_KEY_SWAPS = [
    ("\n#pragma unroll\n      for (int i = 0; i < NKB; i++) {\n",
     "\n      {\n        const __half2 k2 = __float2half2_rn(static_cast<float>(1 << KB));\n#pragma unroll\n"
     "        for (int u = 0; u < NGT; u++) {\n          sa[u] = __hmul2(sa[u], k2); za[u] = __hsub2(za[u], sa[u]);\n"
     "          sb[u] = __hmul2(sb[u], k2); zb[u] = __hsub2(zb[u], sb[u]);\n        }\n      }\n"
     "#pragma unroll\n      for (int i = 0; i < NKB; i++) {\n"),
    ("deq2((w0[j] >> (KB * 2 * e)) & KM2, sa[u], za[u])", "deqs(w0[j], KB, KB * 2 * e, sa[u], za[u])"),
    ("deq2((w1[j] >> (KB * 2 * e)) & KM2, sb[u], zb[u])", "deqs(w1[j], KB, KB * 2 * e, sb[u], zb[u])"),
    ("deq2((w0[j] >> (KB * (2 * e + 1))) & KM2, sa[u], za[u])", "deqs(w0[j], KB, KB * (2 * e + 1), sa[u], za[u])"),
    ("deq2((w1[j] >> (KB * (2 * e + 1))) & KM2, sb[u], zb[u])", "deqs(w1[j], KB, KB * (2 * e + 1), sb[u], zb[u])"),
]
# the value products (cuda_mma.VALUES): the tile's two scale pairs scaled, one fma per pair
_VALUE_SWAPS = [
    ("      const __half2 sB = __halves2half2(vsc[2], vsc[3]), zB = __halves2half2(vbi[2], vbi[3]);\n",
     "      const __half2 sB = __halves2half2(vsc[2], vsc[3]), zB = __halves2half2(vbi[2], vbi[3]);\n"
     "      const __half2 v2 = __float2half2_rn(static_cast<float>(1 << VB));\n"
     "      const __half2 SA = __hmul2(sA, v2), ZA = __hsub2(zA, SA), SB = __hmul2(sB, v2), ZB = __hsub2(zB, SB);\n"),
    ("a[r] = deq2((x >> (VB * (e % PPV))) & VM2, r >> 1 ? sB : sA, r >> 1 ? zB : zA);",
     "a[r] = deqs(x, VB, VB * (e % PPV), r >> 1 ? SB : SA, r >> 1 ? ZB : ZA);"),
]


def enabled() -> bool:
    """MLXKV_CUDA_DEQ=scaled: form 3's products dequantize scaled codes (this module); unset: form 3 as it is."""
    return os.environ.get("MLXKV_CUDA_DEQ", "") == "scaled"


def _swap(text: str, pairs: list[tuple[str, str]]) -> str:
    return rewrite(text, pairs, "cuda_scaled")  # a changed piece must fail here, not time form 3 as this variant


def pieces() -> list[tuple[str, str]]:
    """(form 3's key products, on scaled codes), (its value products, on scaled codes)."""
    return [(cuda_stage.KEY_MMA, _swap(cuda_stage.KEY_MMA, _KEY_SWAPS)), (cuda_mma.VALUES, _swap(cuda_mma.VALUES, _VALUE_SWAPS))]


def body() -> str:
    """Form 3's body (cuda_form3.BODY) with its key and value products on scaled codes."""
    return _swap(cuda_form3.BODY, pieces())
