"""TurboQuant's query rotation and the output's inverse inside the decode launch (`MLXKV_CUDA_TURBO_ROTATE=1`, opt-in
until timed on the H200), for Hadamard rotations (`codecs/rotation.py`: R x = H (s * x) / sqrt(d), R^T y = s * H y /
sqrt(d), H Sylvester's) and launches that merge their splits themselves.

A turbo layer's steady step ran four launches around the kernel: the signs and the Hadamard transform of the
query, the transform and the signs (with the one rounding to the query's dtype) of the output: 458 us of a 7.6 ms
step at 32k on the H200 (run 17, ncu), and four MLX nodes a layer on the host. Here each block rotates its own query
vectors in shared memory before packing their fragments (QVB vectors of D floats: the signs, log2 D butterfly passes,
the 1 / sqrt(D) folded into the fragments' scale), and the block that merges the splits rotates its merged outputs
back before writing them, rounding once to the output's dtype. The signs ride after the key codebook in the `kcb`
input (`book_with_signs`), so the kernel's inputs are unchanged. The butterflies visit pairs (lo, lo + len) for len
= 1, 2, 4, ...: the same transform as `mx.hadamard_transform` (Sylvester's order), up to float32 rounding.
"""

from __future__ import annotations

import os
from functools import cache

import mlx.core as mx

from .cuda_mma import QUERIES
from .cuda_source import rewrite


def enabled() -> bool:
    return os.environ.get("MLXKV_CUDA_TURBO_ROTATE", "") == "1"


@cache
def _book(book_id: int, signs_id: int, book: mx.array, signs: mx.array) -> mx.array:
    out = mx.concatenate([book.astype(mx.float32).reshape(-1), signs.astype(mx.float32).reshape(-1)])
    mx.eval(out)
    return out


def book_with_signs(book: mx.array, signs: mx.array) -> mx.array:
    """The key codebook (2^bits floats) followed by the rotation's signs (dim floats): what `kcb` holds for a rotating
    launch (made once per codebook and rotation)."""
    return _book(id(book), id(signs), book, signs)


# the butterflies over `n` vectors of `len` floats in shared memory `buf`, the block's threads together
def _butterflies(buf: str, vectors: str, dim: str) -> str:
    return (f"    for (int len = 1; len < {dim}; len <<= 1) {{\n"
            f"      for (int i = tid; i < {vectors} * ({dim} / 2); i += THREADS) {{\n"
            f"        const int j = i % ({dim} / 2), lo = (i / ({dim} / 2)) * {dim} + (j / len) * 2 * len + j % len;\n"
            f"        const float x = {buf}[lo], y = {buf}[lo + len];\n"
            f"        {buf}[lo] = x + y;\n        {buf}[lo + len] = x - y;\n      }}\n      __syncthreads();\n    }}\n")


ROTATED_QUERIES = r"""
    // the block's query vectors rotated as the stored keys are, R q = H (s * q) / sqrt(D), in the partials' scratch
    // (free until the loop ends); then each lane packs its fragments from them as from q
    float* qr = reinterpret_cast<float*>(smem);  // [QVB][D]
    const float* sgn = kcb + (1 << KB);
    for (int i = tid; i < QVB * D; i += THREADS) {
      const int vl = i / D, d = i % D, v = qc * QVB + vl;
      qr[i] = static_cast<float>(q[b * q_strides[0] + (h * REP + v / NQ) * q_strides[1] + (v % NQ) * q_strides[2] +
                                   d * q_strides[3]]) * sgn[d];
    }
    __syncthreads();
""" + _butterflies("qr", "QVB", "D") + r"""    const float* qv = qr + min(g, QVB - 1) * D;
    const float sc = g < QVB ? scale * L2E * rsqrtf(static_cast<float>(D)) : 0.f;
#pragma unroll
    for (int i = 0; i < NKB; i++) {
      const int d0 = EPK * (WTK * c + i / (PPK / 2)) + 2 * (i % (PPK / 2));
      qa[i][0] = pack_h2(qv[d0] * sc, qv[d0 + PPK] * sc);
      qa[i][1] = pack_h2(qv[d0 + 1] * sc, qv[d0 + 1 + PPK] * sc);
    }
    __syncthreads();  // every lane's fragments packed before a warp's partials reuse the scratch
  } else {"""

# the merged outputs of the rotating launch: into shared memory, then rotated back a whole vector at a time
_WRITE = """      OT* o = out + (((long long)b * HQ + hq) * NQ + n) * DV + d4 * 4;
      o[0] = static_cast<OT>(den > 0.f ? num.x / den : 0.f);
      o[1] = static_cast<OT>(den > 0.f ? num.y / den : 0.f);
      o[2] = static_cast<OT>(den > 0.f ? num.z / den : 0.f);
      o[3] = static_cast<OT>(den > 0.f ? num.w / den : 0.f);
"""
_ROTATED_WRITE = """      if constexpr (ROT) {  // rotated back below, a whole vector at a time
        float* r = rot + vl * DV + d4 * 4;
        r[0] = den > 0.f ? num.x / den : 0.f;
        r[1] = den > 0.f ? num.y / den : 0.f;
        r[2] = den > 0.f ? num.z / den : 0.f;
        r[3] = den > 0.f ? num.w / den : 0.f;
      } else {
""" + _WRITE + "      }\n"
_INVERSE = r"""    if constexpr (ROT) {  // R^T y = s * H y / sqrt(DV), rounded once to the output's type
      __syncthreads();
""" + _butterflies("rot", "QVB", "DV") + r"""      const float* sgn = kcb + (1 << KB);
      const float inv = rsqrtf(static_cast<float>(DV));
      for (int i = tid; i < QVB * DV; i += THREADS) {
        const int vl = i / DV, d = i % DV, v = qc * QVB + vl, hq = h * REP + v / NQ, n = v % NQ;
        out[(((long long)b * HQ + hq) * NQ + n) * DV + d] = static_cast<OT>(rot[i] * inv * sgn[d]);
      }
    }
"""


def queries() -> str:
    """cuda_mma.QUERIES with a rotating launch's branch (ROT, a constant of turbo plans)."""
    return rewrite(QUERIES, [("  uint32_t qa[NKB][2];\n  {\n", "  uint32_t qa[NKB][2];\n  if constexpr (ROT) {\n"
                                                                  + ROTATED_QUERIES + "\n")], "cuda_rotate")


def tail(text: str) -> str:
    """The in-launch merge (`cuda_source.tail()`) with a rotating launch's outputs rotated back."""
    return rewrite(text, [("    float* dens = scratch + QVB * NSPLIT;  // [QVB]\n",
                           "    float* dens = scratch + QVB * NSPLIT;  // [QVB]\n"
                           "    float* rot = dens + QVB;               // [QVB][DV]: a rotating launch's outputs\n"),
                          (_WRITE, _ROTATED_WRITE),
                          ("    }\n    if (tid == 0) *counter = 0;\n", "    }\n" + _INVERSE + "    if (tid == 0) *counter = 0;\n")],
                   "cuda_rotate")


def smem_floats(qvb: int, value_dim: int) -> int:
    """Floats of shared memory the merge's rotated outputs take beyond its weights and denominators."""
    return qvb * value_dim
