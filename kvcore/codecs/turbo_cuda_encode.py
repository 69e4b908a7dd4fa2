"""TurboQuant's encode in one CUDA launch (the CUDA default since run 12: its device tests pass and a 128k
prefill into turbo:k4v3 went from 0.57x to ~0.96x of affine:4's; `MLXKV_CUDA_TURBO_ENCODE=0` keeps the portable
encode): what `TurboCodec.encode` computes for Hadamard rotations, from the model's K or V to the packed cell
indices and the float16 scale.

The portable encode is 18 MLX nodes per K or V (the signs and the Hadamard transform, the norm, the cell
index, the centroid gather, the least-squares scale, the packing): a decode step encodes each layer's new
token through 36 of them where affine's joint encode is one launch, and the step is host-bound on CUDA
(run 11: turbo:k4v3 8.2 ms a step behind affine:4 at 32k, ~1.3 ms of it in the attention kernel). Here one
warp encodes one head vector, the D / 32 consecutive elements of lane l in its registers:
1. y = H (s * x) / sqrt(D): the fast Walsh-Hadamard butterflies in natural (Sylvester) order, in registers
   for pairs inside a lane and through `__shfl_xor_sync` across lanes;
2. the norm |y| (a warp sum), z = y * (sqrt(D) / max(|y|, 1e-30)), the cell index = how many of the
   codebook's boundaries lie below z (`cell_index`'s count, by binary search);
3. s = <y, c> / max(<c, c>, 1e-30) over the centroids c of the cells (two warp sums), stored as float16;
4. the indices' little-endian bit stream (element i at bits [i * BITS, (i + 1) * BITS)), assembled in shared
   memory and written as bytes: `bitpack.pack`'s layout.
The sums and the transform run in another order than MLX's kernels, so a result can differ from the portable
encode in float rounding: a cell index only where z lies within rounding of a boundary, a scale by one
float16 step. Each (bits, dim, input dtype) is admitted on the device the first time it is asked for only
if its cells match the portable encode's but for at most 1 in 10 000 and its scales are equal or one float16
step apart (`check`); QR rotations (dims that are not powers of two), CPU and Metal keep the portable encode.
"""

from __future__ import annotations

import math
import os

import mlx.core as mx
import numpy as np

from ..backend import Verdicts, backend_name, cpu_reference, unpooled
from .turbo_cuda import DTYPES  # the input dtypes, as the decode launch's outputs

SOURCE = r"""
  constexpr int EPL = D / 32, NB = (1 << BITS) - 1, NW = (D * BITS + 31) / 32, NBY = D * BITS / 8;
  __shared__ uint32_t sw[WARPS][NW];
  __shared__ float sb[NB], sc[NB + 1];
  for (int i = threadIdx.x; i < NB; i += blockDim.x) sb[i] = bd[i];
  for (int i = threadIdx.x; i <= NB; i += blockDim.x) sc[i] = cb[i];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int H = x_shape[1], T = x_shape[2];
  const long long vecs = (long long)x_shape[0] * H * T;
  const long long v = (long long)blockIdx.x * WARPS + warp;
  for (int i = lane; i < NW; i += 32) sw[warp][i] = 0u;
  __syncthreads();
  if (v >= vecs) return;
  const int t = v % T, h = (v / T) % H, b = v / ((long long)T * H);
  const long long base = b * x_strides[0] + h * x_strides[1] + t * x_strides[2];
  float y[EPL];
#pragma unroll
  for (int e = 0; e < EPL; e++) {
    const int d = EPL * lane + e;
    y[e] = static_cast<float>(x[base + d * x_strides[3]]) * sg[d];
  }
#pragma unroll
  for (int hh = 1; hh < EPL; hh <<= 1) {  // butterflies of pairs inside the lane
#pragma unroll
    for (int e = 0; e < EPL; e++) {
      if (!(e & hh)) { const float a = y[e], c = y[e + hh]; y[e] = a + c; y[e + hh] = a - c; }
    }
  }
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {  // butterflies across lanes: pair (i, i + EPL m) sits in lanes (l, l ^ m)
    const bool upper = lane & m;
#pragma unroll
    for (int e = 0; e < EPL; e++) {
      const float o = __shfl_xor_sync(0xffffffffu, y[e], m);
      y[e] = upper ? o - y[e] : y[e] + o;
    }
  }
  float ss = 0.f;
#pragma unroll
  for (int e = 0; e < EPL; e++) { y[e] *= RSQRT_D; ss += y[e] * y[e]; }
#pragma unroll
  for (int m = 16; m; m >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, m);
  const float f = SQRT_D / fmaxf(sqrtf(ss), 1e-30f);
  float dot = 0.f, cc = 0.f;
#pragma unroll
  for (int e = 0; e < EPL; e++) {
    const float z = y[e] * f;
    int lo = 0, hi = NB;  // how many boundaries lie below z
    while (lo < hi) { const int mid = (lo + hi) >> 1; if (z > sb[mid]) lo = mid + 1; else hi = mid; }
    const float c = sc[lo];
    dot += y[e] * c;
    cc += c * c;
    const int o = (EPL * lane + e) * BITS, w = o >> 5, sh = o & 31;
    atomicOr(&sw[warp][w], (uint32_t)lo << sh);
    if (sh + BITS > 32) atomicOr(&sw[warp][w + 1], (uint32_t)lo >> (32 - sh));
  }
#pragma unroll
  for (int m = 16; m; m >>= 1) {
    dot += __shfl_xor_sync(0xffffffffu, dot, m);
    cc += __shfl_xor_sync(0xffffffffu, cc, m);
  }
  __syncwarp();
  uint8_t* po = packed + v * NBY;
  for (int j = lane; j < NBY; j += 32) po[j] = (sw[warp][j >> 2] >> (8 * (j & 3))) & 255u;
  if (lane == 0) scale[v] = __float2half_rn(dot / fmaxf(cc, 1e-30f));
"""

WARPS = 4  # head vectors per block of 128 threads
DIMS = (32, 64, 128, 256)
MISMATCH = 1e-4  # admitted: cells differing from the portable encode's in at most this share of coordinates
_KERNELS: dict = {}  # (bits, dim) -> kernel
_VERDICTS = Verdicts("turbo encode")  # (bits, dim, dtype) -> None (admitted) or why not


def enabled() -> bool:
    return os.environ.get("MLXKV_CUDA_TURBO_ENCODE", "1") != "0"


def _f32(v: float) -> str:
    return f"{float(np.float32(v)).hex()}f"  # the exact float32 constant (a hex literal)


def _kernel(bits: int, dim: int):
    k = _KERNELS.get((bits, dim))
    if k is None:
        from ..attention.cuda_source import compact, kernel_name

        consts = (f"constexpr int BITS = {bits};\nconstexpr int D = {dim};\nconstexpr int WARPS = {WARPS};\n"
                  f"constexpr float SQRT_D = {_f32(dim ** 0.5)};\nconstexpr float RSQRT_D = {_f32(1 / math.sqrt(dim))};\n")
        text = consts + compact(SOURCE)
        k = _KERNELS[(bits, dim)] = mx.fast.cuda_kernel(
            name=kernel_name("mlxkv_turbo_encode", text), input_names=["x", "sg", "bd", "cb"],
            output_names=["packed", "scale"], source=text, ensure_row_contiguous=False)
    return k


def launch(x: mx.array, codec) -> tuple[mx.array, mx.array]:
    """x (B, H, T, D) -> ((B, H, T, D * bits / 8) uint8 packed cells, (B, H, T, 1) float16 scales)."""
    B, H, T, D = x.shape
    vecs = B * H * T
    blocks = -(-max(vecs, 1) // WARPS)
    packed, scale = _kernel(codec.bits, D)(
        inputs=[x, codec.rotation.signs, unpooled(_boundaries(codec.bits)), unpooled(codec.centroids)],
        grid=(blocks * 32 * WARPS, 1, 1), threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(B, H, T, D * codec.bits // 8), (B, H, T, 1)], output_dtypes=[mx.uint8, mx.float16])
    return packed, scale


_BOUNDS: dict = {}


def _boundaries(bits: int) -> mx.array:
    b = _BOUNDS.get(bits)
    if b is None:
        from .lloyd_max import gaussian_codebook

        b = _BOUNDS[bits] = mx.array(gaussian_codebook(bits)[1].astype(np.float32))
    return b


def encode(codec, x: mx.array) -> tuple[mx.array, mx.array] | None:
    """`codec.encode(x)` in one launch, or None where it does not serve (the portable encode then does)."""
    if x.ndim != 4 or encoder(codec, x.dtype, x.shape[-1]) is None:
        return None
    return launch(x, codec)


def encoder(codec, dtype, dim: int):
    """`encode(codec, x)` for this codec's inputs of `dtype` and head dim `dim` as one function, its checks made
    once (the launch, or None where it does not serve): a cache keeps it for its decode steps, each of which
    otherwise pays ~3.7 us of checks per K or V on the host (scripts/host_step.py's stand-ins)."""
    if not enabled() or backend_name() != "cuda" or codec.rotation.signs is None:
        return None
    if dtype not in DTYPES or dim not in DIMS or (dim * codec.bits) % 8 or not admitted(codec, dtype):
        return None
    return lambda x: launch(x, codec) if x.ndim == 4 else codec.portable_encode(x)


def admitted(codec, dtype) -> bool:
    return _VERDICTS.admitted((codec.bits, codec.head_dim, dtype), lambda: check(codec, dtype))


def compare(got: tuple, want: tuple, bits: int, dim: int) -> str | None:
    """None when `got` (packed, scale) is the portable encode `want` up to float rounding: cells equal but for at
    most MISMATCH of the coordinates, scales equal or one float16 step apart; else what differs."""
    from .bitpack import unpack

    if [a.shape for a in got] != [a.shape for a in want] or [a.dtype for a in got] != [a.dtype for a in want]:
        return "the turbo encode kernel's shapes or dtypes differ from the portable encode's"
    gi, wi = unpack(got[0], bits, dim), unpack(want[0], bits, dim)
    cells = (gi != wi).astype(mx.float32).mean().item()
    step = mx.abs(got[1].view(mx.uint16).astype(mx.int32) - want[1].view(mx.uint16).astype(mx.int32)).max().item()
    if cells > MISMATCH or step > 1:
        return (f"the turbo encode kernel differs from the portable encode ({bits} bits, d {dim}): "
                f"{cells:.2%} of cells, scales up to {step} float16 steps apart")
    return None


def check(codec, dtype) -> str | None:
    """The launch against the portable encode (on the CPU) on random head vectors (scaled, outlying, zero and
    constant ones, read through the strides of a transposed and sliced buffer, as a model's keys are)."""
    d = codec.head_dim
    key = mx.random.key(codec.bits * 1000 + d)
    r = mx.random.normal((2, 41, 3, d), key=key) * mx.array([1.0, 0.01, 30.0])[None, None, :, None]
    r = mx.concatenate([r, mx.zeros_like(r[:, :1]), mx.full(r[:, :1].shape, 0.75)], axis=1)
    x = r.transpose(0, 2, 1, 3)[:, :, 2:].astype(dtype)  # (2, 3, 41, d) through strides
    got = launch(x, codec)
    mx.eval(x, got)
    with cpu_reference():
        want = codec.portable_encode(x)
        mx.eval(want)
    return compare(got, want, codec.bits, d)
