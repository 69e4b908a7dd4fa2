"""TurboQuant K/V in form 3's lean loop (`MLXKV_CUDA_TURBO_FORM=3`, opt-in until checked and timed on the H200):
turbo's decode body (`cuda_turbo_mma`, form 1: queries as the score mma's A operand, rows 8..15 zero) moved to form
3's arithmetic (`cuda_form3`: keys as A, the query fragments as B, two accumulator chains: 16 score products a
16-token tile instead of 24) and the lean loop's per-tile savings (`cuda_lean`: one loop per key load width, the
row's base hoisted, no rescale when no maximum moved). For affine rows the same moves took the kernel from 98.0
to 84.9 us at 128k (runs 19, 21); turbo's form-1 body took ~120 us there (run 16), 14% over affine's form 1 for
20% fewer bytes, and P9 (turbo:k4v3 at 128k >= 1.3x mlx-lm) is missed by 26% (run 21).

What changes from form 3 (all else is its text):
- keys: the lane's words of tokens t0 + g and t0 + 8 + g read as bytes (turbo rows are uint8), each element pair's
  two codes looked up in the key book (`lut2`, fp16 in shared memory) instead of scaled; no scales or biases;
- each token's key norm multiplies its two scores after the products (a token's norm factors out of its dot
  product), as form 1's turbo body does;
- each token's value norm multiplies its probabilities as they are packed into P^T's fragment (the denominator
  keeps the plain probabilities); the lane's tokens there are the same two (t0 + g, t0 + 8 + g), so one load a
  token serves both norms;
- values: turbo's loads and code-pair products (`cuda_turbo_mma`: form 1's value arrangement, which form 3 keeps).
"""

from __future__ import annotations

import os
from functools import cache

from . import cuda_form3, cuda_lean, cuda_stage, cuda_turbo_mma
from .cuda_mma import MERGE, QUERIES, VALUE_LOADS, VALUES
from .cuda_source import rewrite


def enabled() -> bool:
    """MLXKV_CUDA_TURBO_FORM=3: turbo rows on this body; unset: form 1's turbo body (cuda_turbo_mma.py)."""
    return os.environ.get("MLXKV_CUDA_TURBO_FORM", "") == "3"


# keys of tokens t0 + g (w0) and t0 + 8 + g (w1): this lane's words of each byte row, and both tokens' key and value
# norms (rows past t_end repeat the last)
KEY_LOADS = r"""
    float s[4] = {0.f, 0.f, 0.f, 0.f}, s2[4] = {0.f, 0.f, 0.f, 0.f};  // even / odd k-blocks: two chains
    float kna, knb, vna, vnb;  // norms of tokens t0 + g, t0 + 8 + g: keys, values
    {
      uint32_t w0[WTK], w1[WTK];
#pragma unroll
      for (int r = 0; r < 2; r++) {
        const int t = min(t0 + 8 * r + g, t_end - 1);
        const int pb = pbt, tp = PAGED ? t % PAGE : t;
        load_words<WTK>(r ? w1 : w0, row_base(kw, 1, kw_strides.data(), pb, h) + tp * ktb + 4 * WTK * c, kvec);
        const float kn = __half2float((ks + (pb * ks_strides[0] + h * ks_strides[1]))[tp * static_cast<int>(ks_strides[2])]);
        const float vn = __half2float((vs + (pb * vs_strides[0] + (h + VH) * vs_strides[1]))[tp * static_cast<int>(vs_strides[2])]);
        if (r) { knb = kn; vnb = vn; } else { kna = kn; vna = vn; }
      }
"""

_KEY_LUT = [
    ("deq2((w0[j] >> (KB * 2 * e)) & KM2, sa[u], za[u])", "lut2(kbook, (w0[j] >> (KB * 2 * e)) & KM2)"),
    ("deq2((w1[j] >> (KB * 2 * e)) & KM2, sb[u], zb[u])", "lut2(kbook, (w1[j] >> (KB * 2 * e)) & KM2)"),
    ("deq2((w0[j] >> (KB * (2 * e + 1))) & KM2, sa[u], za[u])", "lut2(kbook, (w0[j] >> (KB * (2 * e + 1))) & KM2)"),
    ("deq2((w1[j] >> (KB * (2 * e + 1))) & KM2, sb[u], zb[u])", "lut2(kbook, (w1[j] >> (KB * (2 * e + 1))) & KM2)"),
]
_NORMS = [  # key norms into the scores (before the mask), value norms into the packed probabilities
    ("? s[0] + s2[0] : NEG", "? (s[0] + s2[0]) * kna : NEG"),
    ("? s[1] + s2[1] : NEG", "? (s[1] + s2[1]) * kna : NEG"),
    ("? s[2] + s2[2] : NEG", "? (s[2] + s2[2]) * knb : NEG"),
    ("? s[3] + s2[3] : NEG", "? (s[3] + s2[3]) * knb : NEG"),
    ("const uint32_t hA = pack_h2(p0, p1), hB = pack_h2(p2, p3);",
     "const uint32_t hA = pack_h2(p0 * vna, p1 * vna), hB = pack_h2(p2 * vnb, p3 * vnb);"),
]


@cache
def body(value_dim: int, lean: bool = True) -> str:
    """Form 3's body over turbo rows (the NMB = value_dim / 16 m-blocks of turbo's value products spelled out), in
    the lean loop unless `lean` is false."""
    key_mma = rewrite(cuda_stage.KEY_MMA, _KEY_LUT, "cuda_turbo3")
    softmax = rewrite(cuda_stage.SOFTMAX, _NORMS, "cuda_turbo3")
    values = cuda_turbo_mma._TURBO_VALUES.replace("CODE_PAIRS", cuda_turbo_mma._code_pairs(value_dim // 16))
    loop = rewrite(cuda_form3.LOOP, [(cuda_form3.KEY_LOADS, KEY_LOADS), (cuda_stage.KEY_MMA, key_mma),
                                     (cuda_stage.SOFTMAX, softmax), (VALUE_LOADS, cuda_turbo_mma._TURBO_VALUE_LOADS),
                                     (VALUES, values)], "cuda_turbo3")
    text = cuda_turbo_mma.prelude() + QUERIES + loop + MERGE
    return cuda_lean.lean(text, values=False) if lean else text
