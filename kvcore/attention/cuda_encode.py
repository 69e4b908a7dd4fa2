"""A decode step's K/V encoding in one CUDA launch: affine quantization of the new tokens' keys and
values straight from the model's dtype into joint storage's (words, scales, biases).

The portable encode of a joint step is a concatenation, a float16 cast and `mx.quantize` (and at 8
bits a min, a max and two compiled passes); each is a node MLX encodes on the host, and a decode
step is host-bound on CUDA (benchmarks: about 10 us of host time per node). This kernel is one node
with the same results bit for bit (each plan is compared with the portable encode on the device
the first time it is asked for, and refused where it differs):
- below 8 bits, MLX's affine quantize: scale from the group's min and max in float32, the edge value
  made exact, codes rounded for the float32 scale and bias, both then stored as float16; a bfloat16
  input is rounded to float16 first, as `AffineCodec` does;
- at 8 bits, `_quantize8`: scale (max - min) / 255 and bias min stored as float16, codes rounded
  (half to even) for the stored values.
Words are the little-endian bit stream of the codes (element d at bits [d * bits, (d + 1) * bits)).
"""

from __future__ import annotations

import mlx.core as mx

from ..backend import Verdicts, backend_name

# device functions both encode kernels inline: the row a lane reads, its elements with their min and max,
# the group's scale and bias, a code
HEADER = r"""
struct EncRow { long long base, step; int b, hh, t; bool isv; };

// row r of the launch's (B, 2H, T) rows of joint K/V (keys' heads first): where its elements start, their stride
__device__ __forceinline__ EncRow enc_row(int r, int T, int H, const int64_t* ks, const int64_t* vs) {
  EncRow w;
  w.t = r % T; r /= T;
  w.hh = r % (2 * H); w.b = r / (2 * H);
  w.isv = w.hh >= H;
  const int h = w.isv ? w.hh - H : w.hh;
  const int64_t* st = w.isv ? vs : ks;
  w.base = w.b * st[0] + h * st[1] + w.t * st[2];
  w.step = st[3];
  return w;
}

// N elements from `first` on, as float (a bfloat16 input rounded to float16 first with PRE16), and their
// min and max folded into lo / hi
template <int N, bool PRE16, typename TK, typename TV>
__device__ __forceinline__ void enc_load(float* x, float& lo, float& hi, const TK* k, const TV* v, const EncRow& w,
                                         long long first) {
#pragma unroll
  for (int e = 0; e < N; e++) {
    const long long o = w.base + (first + e) * w.step;
    float val = static_cast<float>(w.isv ? v[o] : k[o]);
    if constexpr (PRE16) val = __half2float(__float2half_rn(val));
    x[e] = val;
    lo = fminf(lo, val);
    hi = fmaxf(hi, val);
  }
}

// below 8 bits MLX's affine quantize (edge value made exact); at 8 bits `_quantize8`; stored as float16
template <int BITS>
__device__ __forceinline__ void enc_params(float lo, float hi, float& scale, float& bias, __half& s16, __half& b16) {
  constexpr int NB = (1 << BITS) - 1;
  if constexpr (BITS == 8) {
    s16 = __float2half_rn(fmaxf((hi - lo) / 255.f, 1e-7f));
    b16 = __float2half_rn(lo);
    scale = __half2float(s16);
    bias = __half2float(b16);
  } else {
    scale = fmaxf((hi - lo) / (float)NB, 1e-7f);
    const bool side = fabsf(lo) > fabsf(hi);
    scale = side ? scale : -scale;
    const float edge = side ? lo : hi;
    const float q0 = roundf(edge / scale);
    const bool at_zero = q0 == 0.0f;
    scale = at_zero ? scale : edge / q0;
    bias = at_zero ? 0.f : edge;
    s16 = __float2half_rn(scale);
    b16 = __float2half_rn(bias);
  }
}

template <int BITS>
__device__ __forceinline__ uint32_t enc_code(float x, float scale, float bias) {
  if constexpr (BITS == 8) return (uint32_t)fminf(fmaxf(rintf((x - bias) / scale), 0.f), 255.f);
  else return (uint32_t)fminf(roundf((x - bias) / scale), (float)((1 << BITS) - 1));
}
"""

# a lane per group (3, 5, 6 bits: codes straddle words)
SOURCE = r"""
  constexpr int GW = G * BITS / 32;
  const int H = k_shape[1], T = k_shape[2], D = k_shape[3], NG = D / G, WPR = D * BITS / 32;
  const int total = k_shape[0] * 2 * H * T * NG;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int g = i % NG;
  const EncRow row = enc_row(i / NG, T, H, k_strides.data(), v_strides.data());
  float x[G];
  float lo = 3.402823466e38f, hi = BITS == 8 ? -3.402823466e38f : 0.f;  // MLX's CUDA quantize starts its max at 0
  enc_load<G, PRE16>(x, lo, hi, k, v, row, g * G);
  float scale, bias;
  __half s16, b16;
  enc_params<BITS>(lo, hi, scale, bias, s16, b16);
  s_out[(long long)i] = s16;
  b_out[(long long)i] = b16;
  uint32_t* wo = w_out + ((long long)(row.b * 2 * H + row.hh) * T + row.t) * WPR + g * GW;
  unsigned long long acc = 0ull;
  int nb = 0, wi = 0;
#pragma unroll
  for (int e = 0; e < G; e++) {
    acc |= (unsigned long long)enc_code<BITS>(x[e], scale, bias) << nb;
    nb += BITS;
    if (nb >= 32) {
      wo[wi++] = (uint32_t)acc;
      acc >>= 32;
      nb -= 32;
    }
  }
"""

# bits that divide a word (2, 4, 8): a lane per output word, its group's min and max reduced across the
# group's GW lanes with shuffles (the same values, so the same scale, bias and codes as one lane per group),
# instead of one lane walking a whole group: a decode step's one token had 2 H x groups lanes in all
WORD_SOURCE = r"""
  constexpr int GW = G * BITS / 32, EPW = 32 / BITS;
  const int H = k_shape[1], T = k_shape[2], D = k_shape[3], NG = D / G, WPR = D * BITS / 32;
  const int total = k_shape[0] * 2 * H * T * NG * GW;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const bool live = i < total;
  const unsigned lanes = __ballot_sync(0xffffffffu, live);  // whole groups of GW lanes: total is a multiple of GW
  if (!live) return;
  const int w = i % GW, g = (i / GW) % NG;
  const EncRow row = enc_row(i / GW / NG, T, H, k_strides.data(), v_strides.data());
  float x[EPW];
  float lo = 3.402823466e38f, hi = BITS == 8 ? -3.402823466e38f : 0.f;  // MLX's CUDA quantize starts its max at 0
  enc_load<EPW, PRE16>(x, lo, hi, k, v, row, g * G + w * EPW);
#pragma unroll
  for (int o = 1; o < GW; o <<= 1) {
    lo = fminf(lo, __shfl_xor_sync(lanes, lo, o, GW));
    hi = fmaxf(hi, __shfl_xor_sync(lanes, hi, o, GW));
  }
  float scale, bias;
  __half s16, b16;
  enc_params<BITS>(lo, hi, scale, bias, s16, b16);
  if (w == 0) {  // the group's scale and bias, once
    s_out[i / GW] = s16;
    b_out[i / GW] = b16;
  }
  uint32_t word = 0u;
#pragma unroll
  for (int e = 0; e < EPW; e++) word |= enc_code<BITS>(x[e], scale, bias) << (e * BITS);
  w_out[((long long)(row.b * 2 * H + row.hh) * T + row.t) * WPR + g * GW + w] = word;
"""

_KERNELS: dict = {}  # (bits, group, pre16) -> kernel object (its constants in its source)
_VERDICTS = Verdicts("encode")  # (bits, group, dim, dtype) -> None (admitted) or why not
_COVERS: dict = {}  # (codec class, bits, group, layout, dim, dtype) -> its encoder, or None (asked per decode step)
THREADS = 128
DTYPES = (mx.bfloat16, mx.float16, mx.float32)


def _kernel(bits: int, group: int, pre16: bool):
    """The encode kernel for one setting, made once: its constants are in its source, so a call
    passes no template (MLX formats every template argument into the source on each call)."""
    key = (bits, group, pre16)
    k = _KERNELS.get(key)
    if k is None:
        from .cuda_source import compact, kernel_name

        consts = f"constexpr int BITS = {bits};\nconstexpr int G = {group};\nconstexpr bool PRE16 = {str(pre16).lower()};\n"
        text, head = consts + compact(source_for(bits)), compact(HEADER)
        k = _KERNELS[key] = mx.fast.cuda_kernel(
            name=kernel_name("mlxkv_encode", text, head), input_names=["k", "v"],
            output_names=["w_out", "s_out", "b_out"], source=text, header=head, ensure_row_contiguous=False)
    return k


def source_for(bits: int) -> str:
    """The encode kernel's text: a lane per output word where the codes divide a word, else a lane per group."""
    return WORD_SOURCE if 32 % bits == 0 else SOURCE


def lanes(B: int, H: int, T: int, D: int, bits: int, group: int) -> int:
    """Threads of one launch: a lane per output word (word-dividing codes) or per group."""
    groups = B * 2 * H * T * (D // group)
    return groups * (group * bits // 32) if 32 % bits == 0 else groups


def launch(keys: mx.array, values: mx.array, bits: int, group: int, kernel=None) -> tuple[mx.array, mx.array, mx.array]:
    """keys, values (B, H, T, D) -> joint (B, 2H, T, D*bits/32) uint32 words, (B, 2H, T, D/group)
    float16 scales and biases (keys' heads first)."""
    B, H, T, D = keys.shape
    total = lanes(B, H, T, D, bits, group)
    meta = (B, 2 * H, T, D // group)
    kernel = kernel or _kernel(bits, group, keys.dtype == mx.bfloat16 and bits != 8)
    return tuple(kernel(  # whole warps (the word lanes' shuffles run over full warps)
        inputs=[keys, values], grid=(-(-total // 32) * 32, 1, 1), threadgroup=(min(THREADS, -(-total // 32) * 32), 1, 1),
        output_shapes=[(B, 2 * H, T, D * bits // 32), meta, meta], output_dtypes=_OUT_DTYPES,
    ))


_OUT_DTYPES = [mx.uint32, mx.float16, mx.float16]


def encoder(codec, dtype, dim: int):
    """`encode(keys, values)` -> joint parts through the launch, for this codec, input dtype and
    head dim here; None where the launch does not serve. Callers may keep it (it depends on
    nothing else)."""
    if backend_name() != "cuda":
        return None
    key = (type(codec), getattr(codec, "bits", None), getattr(codec, "group", None), getattr(codec, "layout", None),
           dim, dtype)
    hit = _COVERS.get(key, False)
    if hit is False:
        from ..codecs.affine import AffineCodec

        ok = (type(codec) is AffineCodec and codec.layout == "channel" and dtype in DTYPES
              and admitted(codec.bits, codec.group, dim, dtype))
        if ok:
            bits, group, kernel = codec.bits, codec.group, _kernel(codec.bits, codec.group,
                                                                    dtype == mx.bfloat16 and codec.bits != 8)
            hit = lambda k, v: launch(k, v, bits, group, kernel)
        else:
            hit = None
        _COVERS[key] = hit
    return hit


def encode_joint(codec, keys: mx.array, values: mx.array) -> tuple | None:
    """The joint parts of these tokens, as `codec.encode(concat([keys, values], axis=1))` gives
    them, in one launch; None where the launch does not serve (the portable encode then does)."""
    if keys.shape != values.shape or keys.dtype != values.dtype:
        return None
    enc = encoder(codec, keys.dtype, keys.shape[-1])
    return None if enc is None else enc(keys, values)


def admitted(bits: int, group: int, dim: int, dtype) -> bool:
    return _VERDICTS.admitted((bits, group, dim, dtype), lambda: check(bits, group, dim, dtype))


def check(bits: int, group: int, dim: int, dtype) -> str | None:
    """None when the launch equals the portable encode bit for bit on random tokens (with constant,
    zero, one-sided and large-valued groups), else what differs."""
    from ..codecs import CodecSpec
    from ..codecs.affine import AffineCodec

    codec = AffineCodec(CodecSpec("affine", bits, group), dim)
    key = mx.random.key(bits * 1000 + group + dim)
    r = mx.random.normal((2, 3, 7, 2 * dim), key=key) * mx.array([1.0, 0.01, 30.0])[None, :, None, None]
    rows = [r[:, :, :2], mx.zeros_like(r[:, :, :1]), mx.abs(r[:, :, 3:4]), r[:, :, 4:5] + 5, r[:, :, 5:6] - 5,
            mx.full(r[:, :, :1].shape, 0.75)]  # zero, one-sided, shifted and constant groups
    x = mx.concatenate(rows, axis=2).astype(dtype)
    k, v = x[..., :dim], x[..., dim:]  # strided views, as the model's transposed heads are
    got = launch(k, v, bits, group)
    want = codec.encode(mx.concatenate([k, v], axis=1))
    mx.eval(got, want)
    names = ("words", "scales", "biases")
    bad = [n for n, a, b in zip(names, got, want) if a.shape != b.shape or a.dtype != b.dtype
           or not mx.array_equal(a.view(mx.uint16) if a.dtype == mx.float16 else a,
                                 b.view(mx.uint16) if b.dtype == mx.float16 else b).item()]
    return f"the encode kernel's {', '.join(bad)} differ from the portable encode" if bad else None


def status() -> dict:
    return {f"affine{b}/g{g} d{d} {str(t).rsplit('.', 1)[-1]}": why for (b, g, d, t), why in _VERDICTS.items()}
