"""TurboQuant codes decoded in the rotated basis in one CUDA launch: what `TurboCodec._rotated` computes
(`centroid[index] * scale`, in float32), bit for bit, for prefill's scratch and the portable decode.

The portable decode is a chain of MLX nodes with (..., d) float32 temporaries between them: at 3 bits
a word built from the group's bytes, its chunk codes, a table gather, the scale's product and the cast,
about 18 bytes of memory traffic per decoded element against 2.5 for `mx.dequantize`. A prefill chunk
decodes every stored token of a layer, so a 128k prompt decodes its past ~64 times per layer. This
kernel reads each group's bytes once and writes the outputs once: a thread per (row, head, token,
group of 8 indices), its `bits` bytes as one little-endian word, 8 codebook lookups and products.
Inputs are read through their strides (slices of a cache's buffers are not copied). Each (bits, dim,
output dtype) is compared with the portable decode on the device the first time it is asked for, and
refused where it differs; CPU and Metal keep the portable decode.
"""

from __future__ import annotations

import mlx.core as mx

from ..backend import Verdicts, backend_name, cpu_reference, unpooled

SOURCE = r"""
  constexpr int GROUPS = D / 8;
  const int H = p_shape[1], T = p_shape[2];
  const long long total = (long long)p_shape[0] * H * T * GROUPS;
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int g = i % GROUPS;
  long long r = i / GROUPS;
  const int t = r % T; r /= T;
  const int h = r % H, b = r / H;
  const long long pb = b * p_strides[0] + h * p_strides[1] + t * p_strides[2] + (long long)g * BITS * p_strides[3];
  WT word = 0;
#pragma unroll
  for (int j = 0; j < BITS; j++) word |= static_cast<WT>(p[pb + j * p_strides[3]]) << (8 * j);
  const float sv = static_cast<float>(s[b * s_strides[0] + h * s_strides[1] + t * s_strides[2]]);
  OT* o = out + (((long long)b * H + h) * T + t) * D + g * 8;
#pragma unroll
  for (int e = 0; e < 8; e++) o[e] = static_cast<OT>(cb[(word >> (e * BITS)) & ((1 << BITS) - 1)] * sv);
"""

THREADS = 256
DTYPES = (mx.bfloat16, mx.float16, mx.float32)
_KERNELS: dict = {}  # (bits, dim, dtype) -> kernel
_VERDICTS = Verdicts("turbo decode")  # (bits, dim, dtype) -> None (admitted) or why not


def _kernel(bits: int, dim: int, dtype):
    key = (bits, dim, dtype)
    k = _KERNELS.get(key)
    if k is None:
        from ..attention.cuda_source import compact, kernel_name

        ot = {mx.bfloat16: "__nv_bfloat16", mx.float16: "__half", mx.float32: "float"}[dtype]
        consts = (f"constexpr int BITS = {bits};\nconstexpr int D = {dim};\ntypedef {ot} OT;\n"
                  f"typedef {'uint32_t' if bits <= 4 else 'unsigned long long'} WT;\n")
        text = consts + compact(SOURCE)
        k = _KERNELS[key] = mx.fast.cuda_kernel(
            name=kernel_name("mlxkv_turbo_decode", text), input_names=["p", "s", "cb"],
            output_names=["out"], source=text, ensure_row_contiguous=False)
    return k


def launch(packed: mx.array, scale: mx.array, centroids: mx.array, bits: int, dim: int, dtype) -> mx.array:
    """packed (B, H, T, dim * bits / 8) uint8, scale (B, H, T, 1) -> (B, H, T, dim) `dtype`."""
    B, H, T, _ = packed.shape
    total = B * H * T * (dim // 8)
    threads = -(-max(total, 1) // 32) * 32
    return _kernel(bits, dim, dtype)(
        inputs=[packed, scale, unpooled(centroids)], grid=(threads, 1, 1), threadgroup=(min(THREADS, threads), 1, 1),
        output_shapes=[(B, H, T, dim)], output_dtypes=[dtype])[0]


def serves(codec, dtype) -> bool:
    """Whether the launch decodes `codec`'s codes to `dtype` here (CUDA, a covered head dim and dtype, and this
    setting's device check passed): then a decode holds its output alone, no float32 working arrays."""
    return backend_name() == "cuda" and codec.head_dim % 8 == 0 and dtype in DTYPES and admitted(codec, dtype)


def rotated(codec, enc, dtype) -> mx.array | None:
    """`codec`'s codes in the rotated basis as `dtype` through the launch; None where it does not serve."""
    packed, scale = enc
    if packed.ndim != 4 or packed.dtype != mx.uint8 or packed.shape[-1] != codec.head_dim * codec.bits // 8:
        return None
    if not serves(codec, dtype):
        return None
    return launch(packed, scale, codec.centroids, codec.bits, codec.head_dim, dtype)


def admitted(codec, dtype) -> bool:
    return _VERDICTS.admitted((codec.bits, codec.head_dim, dtype), lambda: check(codec, dtype))


def check(codec, dtype) -> str | None:
    """None when the launch equals the portable decode bit for bit on random codes (a strided slice of a
    larger buffer, as a cache's are), else what differs."""
    d = codec.head_dim
    x = mx.random.normal((2, 3, 41, d), key=mx.random.key(codec.bits * 1000 + d)) * 3.0
    packed, scale = codec.encode(x)
    packed, scale = packed[:, :, 3:37], scale[:, :, 3:37]
    got = launch(packed, scale, codec.centroids, codec.bits, d, dtype)
    mx.eval(packed, scale, got)
    with cpu_reference():
        want = codec.portable_rotated((packed, scale)).astype(dtype)
        mx.eval(want)
    same = got.shape == want.shape and got.dtype == want.dtype and mx.array_equal(got, want).item()
    return None if same else f"the turbo decode kernel differs from the portable decode ({codec.bits} bits, d {d})"


def status() -> dict:
    return {f"turbo{b} d{d} {str(t).rsplit('.', 1)[-1]}": why for (b, d, t), why in _VERDICTS.items()}
