"""The lean loop over full tiles with pointers the loop carries (`MLXKV_CUDA_LEAN=2`, opt-in until timed on the H200).

Form 3's lean loop (`cuda_lean`) finds each load's address anew every tile: the token clamped to the row's end
(`min(t, t_end - 1)`), then row base + token x stride for the key words, scales and biases of two rows and the value
words, scales and biases of four tokens, in 64-bit arithmetic (IMAD 60, LEA 37, IADD3 24 of 567 instructions a tile,
`scripts/cuda_compile_check.py`). Constant strides or dropping the clamp alone made ptxas's loop longer (637, 645:
BENCHMARKS.md, run 23's CPU section). Here, for rows that are not paged, the vector loop runs the warp's full tiles
(`t0 + 16 <= t_end`, where no token needs the clamp) with one pointer an array and lane, set at the warp's first tile
and advanced by a tile's bytes, the second key row and the other value tokens at offsets fixed for the launch; the
warp's last tile, if not full, runs the lean loop's text as it is, from where the full tiles stopped. Same tokens,
same loads, same arithmetic in the same order: the outputs are the lean loop's bit for bit. NVRTC for sm_90a,
llama-8b attention: 542 instructions a tile for affine:4 (LEA 16), 557 for affine:8 (against 567 / 569), 128
registers, no spill.
"""

from __future__ import annotations

from .cuda_lean import _LOOP_START as FOR, VEC_END, VEC_HEAD
from .cuda_source import rewrite

SETUP = r"""
  int t0 = t_begin + 16 * warp;
  // full tiles: each array's pointer for this lane at the warp's first tile, advanced a tile at a time
  const unsigned char* kp = row_base(kw, 4, kw_strides.data(), b, h) + static_cast<long long>(t0 + g) * ktb + 4 * WTK * c;
  const __half* ksp = ks + (b * ks_strides[0] + h * ks_strides[1]) + static_cast<long long>(t0 + g) * ks_strides[2];
  const __half* kbp = kb + (b * kb_strides[0] + h * kb_strides[1]) + static_cast<long long>(t0 + g) * kb_strides[2];
  const int vgrp = (VPL * g) / VG;
  const unsigned char* vp = row_base(vw, 4, vw_strides.data(), b, h + VH) + static_cast<long long>(t0 + 2 * c) * vtb
                            + 4 * WTV * g;
  const __half* vsp = vs + (b * vs_strides[0] + (h + VH) * vs_strides[1]) + static_cast<long long>(t0 + 2 * c) * vs_strides[2]
                      + vgrp * vs_strides[3];
  const __half* vbp = vb + (b * vb_strides[0] + (h + VH) * vb_strides[1]) + static_cast<long long>(t0 + 2 * c) * vb_strides[2]
                      + vgrp * vb_strides[3];
  const long long kadv = 16ll * NWARP * ktb, vadv = 16ll * NWARP * vtb, k8 = 8ll * ktb;
  const long long ksadv = 16ll * NWARP * ks_strides[2], kbadv = 16ll * NWARP * kb_strides[2];
  const long long vsadv = 16ll * NWARP * vs_strides[2], vbadv = 16ll * NWARP * vb_strides[2];
  const int ks8 = 8 * static_cast<int>(ks_strides[2]), kb8 = 8 * static_cast<int>(kb_strides[2]);
"""

# (lean loop's text, the full tiles' text): the loop's head, then each load's address from the carried pointers
PIECES = [
    (FOR, "  for (; t0 + 16 <= t_end; t0 += 16 * NWARP, kp += kadv, ksp += ksadv, kbp += kbadv, vp += vadv, "
          "vsp += vsadv, vbp += vbadv) {"),
    ("        const int t = min(t0 + 8 * r + g, t_end - 1);\n        const int pb = pbt, tp = PAGED ? t % PAGE : t;\n", ""),
    ("load_words<WTK>(r ? w1 : w0, row_base(kw, 4, kw_strides.data(), pb, h) + tp * ktb + 4 * WTK * c, VEC);",
     "load_words<WTK>(r ? w1 : w0, kp + (r ? k8 : 0), VEC);"),
    ("        const __half* ksr = ks + (pb * ks_strides[0] + h * ks_strides[1]);\n", ""),
    ("        const __half* kbr = kb + (pb * kb_strides[0] + h * kb_strides[1]);\n", ""),
    ("        const int mo = tp * static_cast<int>(ks_strides[2]), zo = tp * static_cast<int>(kb_strides[2]);\n", ""),
    ("(r ? sb : sa)[u] = __half2half2(ksr[mo + grp * static_cast<int>(ks_strides[3])]);",
     "(r ? sb : sa)[u] = __half2half2(ksp[(r ? ks8 : 0) + grp * static_cast<int>(ks_strides[3])]);"),
    ("(r ? zb : za)[u] = __half2half2(kbr[zo + grp * static_cast<int>(kb_strides[3])]);",
     "(r ? zb : za)[u] = __half2half2(kbp[(r ? kb8 : 0) + grp * static_cast<int>(kb_strides[3])]);"),
    ("      const int t = min(t0 + 2 * c + (k & 1) + 8 * (k >> 1), t_end - 1);\n"
     "      const int pb = pbt, tp = PAGED ? t % PAGE : t;\n", ""),
    ("load_words<WTV>(vwd[k], row_base(vw, 4, vw_strides.data(), pb, h + VH) + tp * vtb + 4 * WTV * g, VEC);",
     "load_words<WTV>(vwd[k], vp + ((k & 1) + 8 * (k >> 1)) * vtb, VEC);"),
    ("      const int grp = (VPL * g) / VG;\n", ""),
    ("vsc[k] = (vs + (pb * vs_strides[0] + (h + VH) * vs_strides[1]))[tp * static_cast<int>(vs_strides[2]) +\n"
     "                                                                   grp * static_cast<int>(vs_strides[3])];",
     "vsc[k] = vsp[((k & 1) + 8 * (k >> 1)) * static_cast<int>(vs_strides[2])];"),
    ("vbi[k] = (vb + (pb * vb_strides[0] + (h + VH) * vb_strides[1]))[tp * static_cast<int>(vb_strides[2]) +\n"
     "                                                                   grp * static_cast<int>(vb_strides[3])];",
     "vbi[k] = vbp[((k & 1) + 8 * (k >> 1)) * static_cast<int>(vb_strides[2])];"),
]
LAST = "  for (; t0 < t_end; t0 += 16 * NWARP) {  // the warp's last tile where it is not full: the lean loop's text"


def carry(lean_text: str) -> str:
    """A lean affine body (`cuda_lean.lean(...)`, with its value words) with its vector loop split, for rows that are
    not paged, into the full tiles over carried pointers and the last tile as it was; paged rows keep the loop."""
    a = lean_text.index(VEC_HEAD) + len(VEC_HEAD)
    b = lean_text.index(VEC_END, a)
    loop = lean_text[a:b]
    full = rewrite(loop, PIECES, "cuda_carry")
    last = rewrite(loop, [(FOR, LAST)], "cuda_carry")
    split = "  if constexpr (!PAGED) {\n" + SETUP + full + "\n" + last + "\n  } else {\n" + loop + "\n  }\n"
    return lean_text[:a] + split + lean_text[b:]
