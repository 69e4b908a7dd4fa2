"""Form 3's loop with less per-tile overhead (the default; `MLXKV_CUDA_LEAN=0` keeps form 3's text as it was).

Same loads, same arithmetic in the same order, so the outputs are form 3's bit for bit; only instructions
that did no work per tile go (`scripts/cuda_compile_check.py --forms 3`, NVRTC's SASS of the main loop):
- **one loop per load width**: the K and V words are read as 16-byte vectors when the arrays allow it
  (`kvec`, `vvec`, known before the loop); form 3 branched per load inside the loop, and ptxas issued both
  the vector loads and the predicated-off word loads every tile. The loop is now written twice, for
  vector loads and for word loads, and the choice is made once.
- **rows that are not paged read their own row** as a constant (`pbt = PAGED ? pb_next : b`): with a loop
  variable there, ptxas recomputed each array's 64-bit row base every tile (18 uniform multiply-adds).
- **the running outputs are rescaled only when a maximum moved**: `exp2f(m_old - m_new)` is exactly 1 when
  no lane's maximum moved, and multiplying by 1 changes nothing, so the warp skips its NMB x 4 products
  (32 at 128 value dims) on tiles where no lane's maximum rose, which at long contexts is most of them.
"""

from __future__ import annotations

import os

from .cuda_source import rewrite

_RESCALE = "    for (int m = 0; m < NMB; m++) { acc[m][0] *= cr0; acc[m][1] *= cr1; acc[m][2] *= cr0; acc[m][3] *= cr1; }\n"
_LOOP_START = "  for (int t0 = t_begin + 16 * warp; t0 < t_end; t0 += 16 * NWARP) {"
_LOOP_END = "\n  float lq0 = l0"  # cuda_stage.PARTIALS follows the loop
VEC_HEAD = "  if (kvec && vvec) {\n  constexpr bool VEC = true;\n"  # the vector loads' loop follows (with values)
VEC_END = "\n  } else {\n  constexpr bool VEC = false;\n"  # then the word loads' loop


def enabled() -> bool:
    return level() > 0


def level() -> int:
    """MLXKV_CUDA_LEAN: 0 form 3's text, 1 the lean loop (the default), 2 the lean loop with carried pointers over
    full tiles (`cuda_carry`, opt-in; affine bodies only)."""
    return {"0": 0, "2": 2}.get(os.environ.get("MLXKV_CUDA_LEAN", "1"), 1)


def lean(body: str, values: bool = True) -> str:
    """A form-3 body (`cuda_form3.BODY`, its scaled-code variant, or turbo's with `values` false: its value rows are
    read a half-word at a time, not as words) with the loop's overheads taken out."""
    start, end = body.index(_LOOP_START), body.index(_LOOP_END)
    loop = rewrite(body[start:end], [  # each piece once: a changed one fails here, not builds form 3 under this name
        ("const int pbt = pb_next;", "const int pbt = PAGED ? pb_next : b;"),
        (", kvec);", ", VEC);"),
        *([(", vvec);", ", VEC);")] if values else []),
        ("#pragma unroll\n" + _RESCALE, "    if (__any_sync(0xffffffffu, cr0 != 1.f || cr1 != 1.f)) {  // a maximum moved\n"
                                        "#pragma unroll\n" + _RESCALE + "    }\n")], "cuda_lean")
    head = VEC_HEAD if values else VEC_HEAD.replace(" && vvec", "")
    both = head + loop + VEC_END + loop + "\n  }\n"
    return body[:start] + both + body[end:]
