"""Form 1 with the next tile's keys in flight (`MLXKV_CUDA_PREFETCH=1`, opt-in until checked and timed on the
H200): the affine word body's loop (`cuda_mma.LOOP`) with its key loads moved one tile ahead; with
`MLXKV_CUDA_PREFETCH=2` its value loads too.

Run 11's source counters at 32k put 35% of form 1's stall samples on the first use of a loaded key word and
20% on the first use of the scores: each warp issues a tile's key loads and waits for them at once, so an SM
has at most its 16 warps' current tiles in flight, and the kernel reads 0.6-1.2 TB/s of the H200's ~4.3. Here a
warp loads tile t + 1's key words, scales and biases (into `wn`, `s2n`, `z2n`) as soon as tile t's scores are
computed, so they arrive while tile t's softmax, value loads and value products run:

```
before the loop:  keys of the warp's first tile -> wn
tile t:           S = Q K^T from wn;  keys of tile t + 1 -> wn;  softmax, V loads, O += V^T P^T
```
The same loads, the same arithmetic and order of accumulation (so the same results bit for bit); the tile's
page (paged rows) is `TILE_PAGE`'s one-tile-ahead lookup, which is exactly the page the prefetch needs. It
costs ~12 registers across the loop (two tokens' key words and their groups' scales): over the 128 that 4
blocks per SM leave, so this form is built for `MLXKV_CUDA_MIN_BLOCKS` = 3 unless that is set.
With values too (`=2`), tile t + 1's value words, scales and biases are loaded once tile t's value products
are done, so they arrive during tile t + 1's key products and softmax: no wait on a load inside a tile.
`=3` leaves form 1's loads as they are and, at the start of each tile, asks L2 for the warp's next tile (or the
one `MLXKV_CUDA_L2_AHEAD` tiles on; paged rows look that tile's page up) (`prefetch.global.L2`: lanes 0-15 its 16 tokens' key rows, scales and biases, lanes 16-31 their values'), so
that tile's loads, issued where form 1 issues them, find their lines in L2 instead of DRAM. It holds no
register across the tile (ptxas sinks loads to their use: moving form 1's value loads above the scores in C++
left them below the score products in SASS, so registers cannot buy the early issue; a prefetch has no result
to sink). Run 12: `=1` tied form 1 at 32k and lost 4% at 128k; `=2` was not timed. Run 13: `=3` tied form 1 at
32k and lost 10% at 128k (131.7 against 119.6 us; two tiles ahead 134.3 against 120.1), its device tests passing.
"""

from __future__ import annotations

import os
from functools import cache

from .cuda_mma import KEY_LOAD, KEY_MMA, KEY_SCALES, LOOP, PAGE_AHEAD, VALUE_DECL, VALUE_LOADS, VALUES

BLOCKS = 3  # blocks per SM this form is built for (168 registers a thread) unless MLXKV_CUDA_MIN_BLOCKS says


def level() -> int:
    """MLXKV_CUDA_PREFETCH: 0 (default) off, 1 keys a tile ahead, 2 keys and values, 3 the next tile asked of L2."""
    v = os.environ.get("MLXKV_CUDA_PREFETCH", "0")
    return int(v) if v in ("1", "2", "3") else 0


def enabled() -> bool:
    return level() > 0


def min_blocks(default: int) -> int:
    """Blocks per SM to build for: MLXKV_CUDA_MIN_BLOCKS, else form 1's for the L2 prefetch (it holds no more
    registers), else at most BLOCKS."""
    if "MLXKV_CUDA_MIN_BLOCKS" in os.environ:
        return int(os.environ["MLXKV_CUDA_MIN_BLOCKS"])
    return default if level() == 3 else min(default, BLOCKS)


def _swap(text: str, pairs: list[tuple[str, str]]) -> str:
    for old, new in pairs:
        if old not in text:  # a changed piece must not leave a silent no-op (the default timed as the variant)
            raise AssertionError(f"cuda_prefetch: {old!r} not in the piece it rewrites")
        text = text.replace(old, new)
    return text


# the key pieces writing into (and reading from) the prefetch registers of token row nb; built when first asked
# for, so a piece of form 1 that no longer matches fails in this variant's tests, not in every kernel import
@cache
def _key_pieces() -> tuple[str, str, str]:
    load = _swap(KEY_LOAD, [("      uint32_t w[WTK];\n", ""), ("load_words<WTK>(w,", "load_words<WTK>(wn[nb],")])
    scales = _swap(KEY_SCALES, [("      __half2 s2[NGT], z2[NGT];\n", ""), ("s2[u] =", "s2n[nb][u] ="),
                                ("z2[u] =", "z2n[nb][u] =")])
    mma = _swap(KEY_MMA, [("w[j]", "wn[nb][j]"), ("s2[u]", "s2n[nb][u]"), ("z2[u]", "z2n[nb][u]")])
    return load, scales, mma


def load_tile(first: str) -> str:
    """The key loads of the warp's tile starting at token `first` (a C expression), page `pb_next`."""
    return (r"""
#pragma unroll
      for (int nb = 0; nb < 2; nb++) {
        const int t = min(""" + first + r""" + 8 * nb + g, t_end - 1);
        const int pb = pb_next, tp = PAGED ? t % PAGE : t;
""" + _key_pieces()[0] + _key_pieces()[1] + "      }\n")


SCORES = r"""    // scores of tokens t0 + 8 nb + (2c, 2c + 1) for query vector g
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
"""


def _prefetched_scores() -> str:
    return (r"""    // scores of tokens t0 + 8 nb + (2c, 2c + 1) for query vector g, from the keys loaded a tile ago
    float s[2][4];
#pragma unroll
    for (int nb = 0; nb < 2; nb++) {
      s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.f;
#pragma unroll
      for (int i = 0; i < NKB; i++) {
""" + _key_pieces()[2] + r"""        mma16816(s[nb], qa[i][0], 0u, qa[i][1], 0u, b0, b1);
      }
    }
    if (t0 + 16 * NWARP < t_end) {  // the next tile's keys, in flight through the rest of this tile
""" + load_tile("t0 + 16 * NWARP") + "    }\n")


def _first() -> str:
    return (r"""  uint32_t wn[2][WTK];
  __half2 s2n[2][NGT], z2n[2][NGT];
  if (t_begin + 16 * warp < t_end) {
""" + load_tile("t_begin + 16 * warp") + "  }\n")


@cache
def _loop_ahead() -> str:
    return _swap(LOOP, [(SCORES, _prefetched_scores()), (PAGE_AHEAD, PAGE_AHEAD + _first())])


def load_values(first: str) -> str:
    """The value loads of the warp's tile starting at token `first`, page `pb_next`, into vwd / vsc / vbi."""
    return _swap(VALUE_LOADS, [(VALUE_DECL, ""), ("    __half vsc[4], vbi[4];\n", ""),
                               ("min(t0 + 2 * c", "min(" + first + " + 2 * c"), ("const int pb = pbt,", "const int pb = pb_next,")])


@cache
def _loop_ahead_values() -> str:
    first_values = VALUE_DECL + r"""  __half vsc[4], vbi[4];
  if (t_begin + 16 * warp < t_end) {
""" + load_values("t_begin + 16 * warp") + "  }\n"
    next_values = r"""    if (t0 + 16 * NWARP < t_end) {  // the next tile's values, in flight through its key products and softmax
""" + load_values("t0 + 16 * NWARP") + "    }\n"
    return _swap(_loop_ahead(), [(PAGE_AHEAD + _first(), PAGE_AHEAD + _first() + first_values),
                                 (VALUE_LOADS + VALUES, VALUES + next_values)])


L2_AHEAD = r"""    if (t0 + 16 * NWARP * L2D < t_end) {  // the warp's tile L2D ahead into L2: no register held, nothing to wait for
      const int tn = min(t0 + 16 * NWARP * L2D + (lane & 15), t_end - 1);
      const int tpn = PAGED ? tn % PAGE : tn;
      const int pbl = L2D == 1 ? pb_next : (PAGED ? ptab[b * PTW + tn / PAGE] : b);  // that tile's page
      const bool vside = lane >= 16;
      const unsigned char* row = vside ? row_base(vw, 4, vw_strides.data(), pbl, h + VH) + tpn * vtb
                                       : row_base(kw, 4, kw_strides.data(), pbl, h) + tpn * ktb;
      const void* sc = vside ? (const void*)(vs + pbl * vs_strides[0] + (h + VH) * vs_strides[1] + (long long)tpn * vs_strides[2])
                             : (const void*)(ks + pbl * ks_strides[0] + h * ks_strides[1] + (long long)tpn * ks_strides[2]);
      const void* bi = vside ? (const void*)(vb + pbl * vb_strides[0] + (h + VH) * vb_strides[1] + (long long)tpn * vb_strides[2])
                             : (const void*)(kb + pbl * kb_strides[0] + h * kb_strides[1] + (long long)tpn * kb_strides[2]);
      asm volatile("prefetch.global.L2 [%0];" :: "l"(row));
      asm volatile("prefetch.global.L2 [%0];" :: "l"(sc));
      asm volatile("prefetch.global.L2 [%0];" :: "l"(bi));
    }
"""


def distance() -> int:
    """MLXKV_CUDA_L2_AHEAD: how many of the warp's tiles ahead `=3` asks L2 for (1, the default, to 4)."""
    v = os.environ.get("MLXKV_CUDA_L2_AHEAD", "1")
    return int(v) if v in ("1", "2", "3", "4") else 1


@cache
def _loop_l2_ahead(ahead: int) -> str:
    return _swap(LOOP, [(SCORES, L2_AHEAD.replace("L2D", str(ahead)) + SCORES)])


def loop(lvl: int, ahead: int = 1) -> str:
    """Form 1's loop with its loads a tile ahead: keys (1), keys and values (2); or the warp's tile `ahead`
    tiles on asked of L2 (3)."""
    if lvl == 3:
        return _loop_l2_ahead(ahead)
    return _loop_ahead_values() if lvl == 2 else _loop_ahead()
