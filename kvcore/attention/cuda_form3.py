"""The third form of the tensor-core decode body (`MLXKV_CUDA_MMA=3`; the default for affine sides whose codes
pair within half-words since run 19, `cuda_mma.form_for`): the staged form's arithmetic (`cuda_stage`: S^T = K Q^T, the dequantized keys as the mma's A
operand, all 16 rows real, the query fragments as B, two accumulator chains, P^T's fragment by four
shuffles) with the register form's loads (`cuda_mma.LOOP`: each lane reads its own K words of tokens
t0 + g and t0 + 8 + g, its V words of tokens 2c, 2c + 1, 2c + 8, 2c + 9 and their scales and biases
from global memory straight into registers; no shared-memory ring, no cp.async).

Form 1's score mma takes the queries as A with rows 8..15 zero (24 HMMA per 16 tokens, this form 16);
form 2 spends ~280 more instructions per 16 tokens staging. CPU build (scripts/cuda_compile_check.py):
main loop 687 instructions for affine:4 against form 1's 714 and form 2's 998, 125 registers, no spills (641
against 671 and 963 with 32-bit in-row offsets, run 19; ncu there: 33.9 / 54.3 / 94.7 us at 32k / 64k / 128k
against form 1's 34.6 / 55.8 / 98.0).
Shared memory, launch bounds and constants are form 1's (`cuda_mma.mma_smem`, `cuda_mma.min_blocks`).
"""

from __future__ import annotations

from .cuda_mma import MERGE, PAGE_AHEAD, PRELUDE, QUERIES, TILE_PAGE, VALUE_LOADS, VALUES
from .cuda_stage import KEY_MMA, LANE_QUERIES, PARTIALS, SOFTMAX

# keys of tokens t0 + g (w0, sa, za) and t0 + 8 + g (w1, sb, zb): this lane's words [WTK c, WTK c + WTK)
# and the scales / biases of the groups they span, from global memory (rows past t_end repeat the last)
KEY_LOADS = r"""
    float s[4] = {0.f, 0.f, 0.f, 0.f}, s2[4] = {0.f, 0.f, 0.f, 0.f};  // even / odd k-blocks: two chains
    {
      uint32_t w0[WTK], w1[WTK];
      __half2 sa[NGT], za[NGT], sb[NGT], zb[NGT];
#pragma unroll
      for (int r = 0; r < 2; r++) {
        const int t = min(t0 + 8 * r + g, t_end - 1);
        const int pb = pbt, tp = PAGED ? t % PAGE : t;
        load_words<WTK>(r ? w1 : w0, row_base(kw, 4, kw_strides.data(), pb, h) + tp * ktb + 4 * WTK * c, kvec);
        const __half* ksr = ks + (pb * ks_strides[0] + h * ks_strides[1]);
        const __half* kbr = kb + (pb * kb_strides[0] + h * kb_strides[1]);
        const int mo = tp * static_cast<int>(ks_strides[2]), zo = tp * static_cast<int>(kb_strides[2]);
#pragma unroll
        for (int u = 0; u < NGT; u++) {
          const int grp = (KPL * c + u * KG) / KG;
          (r ? sb : sa)[u] = __half2half2(ksr[mo + grp * static_cast<int>(ks_strides[3])]);
          (r ? zb : za)[u] = __half2half2(kbr[zo + grp * static_cast<int>(kb_strides[3])]);
        }
      }
"""

LOOP = (LANE_QUERIES + PAGE_AHEAD + "  for (int t0 = t_begin + 16 * warp; t0 < t_end; t0 += 16 * NWARP) {" + TILE_PAGE
        + KEY_LOADS + KEY_MMA + SOFTMAX + VALUE_LOADS + VALUES + "  }\n" + PARTIALS)

BODY = PRELUDE + QUERIES + LOOP + MERGE
