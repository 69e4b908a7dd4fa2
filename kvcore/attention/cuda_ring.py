"""The fourth form of the tensor-core decode body (`MLXKV_CUDA_MMA=4`, opt-in until timed on the H200): form 3's
lean loop (`cuda_lean`, the default) with each warp's tiles brought in through form 2's shared-memory ring
(`cuda_stage`), `cp.async` copies that hold no register while in flight, and a copy issue with no per-row fallback.

Why: form 3 loads a tile's key words, then (after the scores and softmax) its value words, into registers; ptxas
issues each load next to its first use, so a warp waits on two DRAM round trips a tile, and 16 warps an SM keep
~1 KB each in flight: the lean loop reads 1.78 TB/s at 128k (run 21, 84.9 us for 151 MB). Form 2's ring had
STG - 1 tiles in flight per warp but paid ~300 more instructions a tile (every load's clamps and 64-bit products,
and a fallback copy for odd strides or paging in the same loop); it ran 90.4 us at 128k against form 3's 94.7
(run 19). Here the ring takes only what caches hold, checked once a launch (`ring_ok`: rows not paged, K / V rows
of whole 16-byte chunks one token after another, scales and biases contiguous): a tile's key (or value) bytes are
then one run of 16 * row bytes, so copy i of a tile reads bytes [16 i, 16 i + 16) from the tile's first token,
and rows past the row's last token are filled with zeros (`cp.async`'s source size 0: no read) instead of
clamped. Launches that fail the check run the lean loop unchanged, in the same kernel.

Per warp and tile: K and V copies (lane + 32 k), 16-byte pieces of the four scale and bias arrays (one lane each
for 4-bit g64 K / V), the commit, a wait for the tile issued STG - 1 tiles ago, then form 2's reads of the stage
(row strides padded for conflict-free fragment reads, `cuda_stage.stages`) and form 3's arithmetic with the lean
loop's rescale skip. The arithmetic is form 3's, in the same order, so the outputs are form 3's bit for bit.
"""

from __future__ import annotations

import os
from functools import cache

from . import cuda_form3, cuda_lean, cuda_scaled, cuda_stage
from .cuda_mma import PAGE_AHEAD, QUERIES
from .cuda_source import rewrite

HEADER = r"""
// 16 bytes global -> shared, or zeros where `ok` is false (source size 0: nothing is read)
__device__ __forceinline__ void cp_async16z(void* dst, const void* src, bool ok) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(s), "l"(src), "r"(ok ? 16 : 0));
}
// 16 bytes of which the first `n` (0..16) are read, the rest zeros
__device__ __forceinline__ void cp_async16n(void* dst, const void* src, int n) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(s), "l"(src), "r"(n));
}
"""

# after PRELUDE, before the queries: whether this launch's arrays suit the ring, the ring, and its first tiles in
# flight while the query fragments load
SETUP = r"""
  // the ring serves rows laid out as caches hold them (checked once a launch, uniform over the block)
  const bool ring_ok = !PAGED && kvec && vvec && ktb == KRW * 4 && vtb == VRW * 4 &&
                       meta_fast<KNG>(ks, ks_strides.data()) && meta_fast<KNG>(kb, kb_strides.data()) &&
                       meta_fast<VNG>(vs, vs_strides.data()) && meta_fast<VNG>(vb, vb_strides.data());
  const int tstart = t_begin / 16 * 16 + 16 * warp;  // tokens below lo0 are masked
  const int n_it = tstart < t_end ? (t_end - tstart + 16 * NWARP - 1) / (16 * NWARP) : 0;
  unsigned char* ring = smem + warp * STG * STB;
  const unsigned char* kbase = row_base(kw, 4, kw_strides.data(), b, h);
  const unsigned char* vbase = row_base(vw, 4, vw_strides.data(), b, h + VH);
  // this lane's piece of the tile's scales and biases: array a (K scales, K biases, V scales, V biases), piece j
  constexpr int KMC = 2 * KNG, VMC = 2 * VNG, NMC = 2 * KMC + 2 * VMC;  // 16-byte pieces per array and tile
  const unsigned char* msrc[(NMC + 31) / 32];
  int moff[(NMC + 31) / 32], mtb[(NMC + 31) / 32], mj[(NMC + 31) / 32];
#pragma unroll
  for (int k = 0; k < (NMC + 31) / 32; k++) {
    const int i = min(lane + 32 * k, NMC - 1);
    const int a = i < KMC ? 0 : i < 2 * KMC ? 1 : i < 2 * KMC + VMC ? 2 : 3;
    const int j = a < 2 ? i - a * KMC : i - 2 * KMC - (a - 2) * VMC;
    const __half* arr = a == 0 ? ks : a == 1 ? kb : a == 2 ? vs : vb;
    const int64_t* st = a == 0 ? ks_strides.data() : a == 1 ? kb_strides.data() : a == 2 ? vs_strides.data()
                                                                                        : vb_strides.data();
    const int hh = a < 2 ? h : h + VH;
    msrc[k] = reinterpret_cast<const unsigned char*>(arr + (b * st[0] + hh * st[1])) + 16 * j;
    moff[k] = (a == 0 ? SOFF_KS : a == 1 ? SOFF_KZ : a == 2 ? SOFF_VS : SOFF_VZ) + 16 * j;
    mtb[k] = 2 * (a < 2 ? KNG : VNG);  // bytes per token
    mj[k] = 16 * j;
  }
  auto issue = [&](int it) {
    if (it < n_it) {
      const int t0 = tstart + it * 16 * NWARP;
      const int nv = t_end - t0;  // rows of the tile that hold tokens (>= 1)
      unsigned char* st = ring + (it % STG) * STB;
      const unsigned char* kt = kbase + t0 * (KRW * 4);
      const unsigned char* vt = vbase + t0 * (VRW * 4);
#pragma unroll
      for (int k = 0; k < (4 * KRW + 31) / 32; k++) {  // K: piece i is row i / (KRW / 4), column i % (KRW / 4)
        const int i = lane + 32 * k;
        if ((4 * KRW) % 32 == 0 || i < 4 * KRW) {
          const int r = i / (KRW / 4), col = i % (KRW / 4);
          cp_async16z(st + (r * KRS + 4 * col) * 4, kt + 16 * i, r < nv);
        }
      }
#pragma unroll
      for (int k = 0; k < (4 * VRW + 31) / 32; k++) {
        const int i = lane + 32 * k;
        if ((4 * VRW) % 32 == 0 || i < 4 * VRW) {
          const int r = i / (VRW / 4), col = i % (VRW / 4);
          cp_async16z(st + SOFF_V + (r * VRS + 4 * col) * 4, vt + 16 * i, r < nv);
        }
      }
#pragma unroll
      for (int k = 0; k < (NMC + 31) / 32; k++) {
        if (NMC % 32 == 0 || lane + 32 * k < NMC)
          cp_async16n(st + moff[k], msrc[k] + t0 * mtb[k], max(0, min(16, nv * mtb[k] - mj[k])));
      }
    }
    cp_async_commit();
  };
  if (ring_ok) {
#pragma unroll
    for (int i = 0; i < STG - 1; i++) issue(i);  // in flight while the query fragments load
  }
"""

_RING_START = "  for (int it = 0; it < n_it; it++) {"
_RING_END = "  cp_async_wait<0>();\n  __syncthreads();  // the partials below reuse the rings\n"


@cache
def ring_loop() -> str:
    """Form 2's loop over its ring (reads of the stage, form 3's arithmetic), with the lean loop's rescale skip."""
    loop = cuda_stage.LOOP
    text = loop[loop.index(_RING_START): loop.index(_RING_END) + len(_RING_END)]
    return rewrite(text, [("#pragma unroll\n" + cuda_lean._RESCALE,
                           "    if (__any_sync(0xffffffffu, cr0 != 1.f || cr1 != 1.f)) {  // a maximum moved\n"
                           "#pragma unroll\n" + cuda_lean._RESCALE + "    }\n")], "cuda_ring")


def only() -> bool:
    """MLXKV_CUDA_RING=only (tests): a launch the ring does not take writes NaN outputs instead of running the lean
    loop, so a comparison with form 3 fails unless the ring ran."""
    return os.environ.get("MLXKV_CUDA_RING", "") == "only"


_NOT_TAKEN = "    acc[0][0] = __int_as_float(0x7fc00000);  // MLXKV_CUDA_RING=only: the ring did not take this launch\n"


@cache
def body(ring_only: bool = False, scaled: bool = False) -> str:
    """Form 3's lean body with the ring set up before the queries and its loop taken where `ring_ok`; with `scaled`
    every loop's products dequantize scaled codes (`cuda_scaled`, MLXKV_CUDA_DEQ=scaled: one fma a pair)."""
    lean = cuda_lean.lean(cuda_form3.BODY)
    loops_start = lean.index(PAGE_AHEAD)
    loops_end = lean.index(cuda_lean._LOOP_END)
    wrapped = ("  if (ring_ok) {\n" + ring_loop() + "  } else {\n" + (_NOT_TAKEN if ring_only else "")
               + lean[loops_start:loops_end] + "\n  }\n")
    text = lean[:loops_start] + wrapped + lean[loops_end:]
    text = rewrite(text, [(QUERIES, SETUP + QUERIES)], "cuda_ring")
    if scaled:  # the ring loop's products and both lean loops'
        for old, new in cuda_scaled.pieces():
            assert text.count(old) == 3, "cuda_ring: a product piece is not in each of the three loops"
            text = text.replace(old, new)
    return text
