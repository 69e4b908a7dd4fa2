"""Affine (min/max) integer quantization, mlx-lm compatible where head_dim allows.

Two layouts, picked from head_dim:
- "channel": groups of `group_size` along head_dim, one token at a time (mlx-lm's layout).
- "token": for head dims that `group_size` does not divide (stories260K has 8, Phi 80),
  each channel is grouped over `group_size` consecutive tokens (as KIVI does for keys),
  so no padding is stored. A block then holds `group_size` tokens.

Scales and biases are stored as float16 whatever the run dtype: 2 bytes each, which is what
a float16/bfloat16 deployment pays, so bytes per element are (bits + 32/group) / 8.
At 8 bits the codes are chosen for the stored (rounded) scales and biases: `_quantize8`.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx

from .base import CodecSpec, Encoded

BITS = (2, 3, 4, 5, 6, 8)
GROUPS = (32, 64, 128)
META_DTYPE = mx.float16


@partial(mx.compile, shapeless=True)
def _grid8(lo: mx.array, hi: mx.array) -> tuple[mx.array, mx.array]:
    """A group's min and max -> its stored 8-bit scale and bias (META_DTYPE)."""
    s = mx.maximum((hi.astype(mx.float32) - lo.astype(mx.float32)) / 255, 1e-7)
    return s.astype(META_DTYPE), lo.astype(META_DTYPE)


@partial(mx.compile, shapeless=True)
def _codes8(x: mx.array, s: mx.array, b: mx.array) -> mx.array:
    """x (..., G), stored s and b (..., 1) -> the nearest code of each value on the grid b + s*code."""
    q = mx.round((x.astype(mx.float32) - b.astype(mx.float32)) / s.astype(mx.float32))
    return mx.clip(q, 0, 255).astype(mx.uint8)


def _quantize8(x: mx.array, group: int) -> tuple[mx.array, mx.array, mx.array]:
    """x (..., D) -> (..., D/4) uint32 words, (..., D/group) scales and biases x2 (min/max grid).

    The codes are chosen for the stored float16 scale and bias. mx.quantize chooses them for its
    float32 ones; rounding those afterwards (relative error 2**-11) moves a group's values by up
    to 255 * 2**-11 of a step (scale) plus |bias| * 2**-11 (bias), the same way across the group,
    an error a dot product adds up: at 8 bits ~1/8 of a step (SmolLM2 affine:8/g64 on held-out
    text: mean KL 5.0e-4 that way, 4.1e-4 this way); at <= 6 bits <= 1/32, and mx.quantize is kept.
    """
    xg = x.reshape(*x.shape[:-1], -1, group)
    s, b = _grid8(xg.min(axis=-1, keepdims=True), xg.max(axis=-1, keepdims=True))
    codes = _codes8(xg, s, b).reshape(x.shape).view(mx.uint32)  # value i in byte i (little-endian)
    return codes, s[..., 0], b[..., 0]


class AffineCodec:
    def __init__(self, spec: CodecSpec, head_dim: int):
        if spec.bits not in BITS:
            raise ValueError(f"affine bits must be one of {BITS}, got {spec.bits}")
        if spec.group_size not in GROUPS:
            raise ValueError(f"affine group size must be one of {GROUPS}, got {spec.group_size}")
        self.spec = spec
        self.head_dim = head_dim
        self.bits = spec.bits
        self.group = spec.group_size
        self.layout = "channel" if head_dim % self.group == 0 else "token"
        self.block_tokens = 1 if self.layout == "channel" else self.group

    joint = True  # encodes each vector on its own: K and V may share one call and one set of arrays

    def _quantize(self, x: mx.array) -> Encoded:
        if self.bits == 8:
            return _quantize8(x, self.group)
        if x.dtype == mx.bfloat16:
            # exact in float16 for |x| in its normal range, and the scales come out in float16
            # directly: one widening of the input instead of two of the scales and biases
            x = x.astype(META_DTYPE)
        w, s, b = mx.quantize(x, group_size=self.group, bits=self.bits)
        return w, s.astype(META_DTYPE), b.astype(META_DTYPE)

    def encode(self, x: mx.array) -> Encoded:
        if self.layout == "channel":
            return self._quantize(x)  # (B, H, T, D*bits/32), (B, H, T, D/G) x2
        B, H, T, D = x.shape
        nb = T // self.group
        # (B, H, nb, G, D) -> (B, H, nb, D, G): quantize each channel over G tokens
        xt = x.reshape(B, H, nb, self.group, D).swapaxes(-1, -2)
        return self._quantize(xt)  # (B, H, nb, D, G*bits/32), (B, H, nb, D, 1) x2

    def decode(self, enc: Encoded, dtype: mx.Dtype) -> mx.array:
        w, s, b = enc
        # widen the stored float16 scales first: dequantizing with them directly rounds every
        # value to float16 on the way, an error the codec itself does not make
        s, b = s.astype(dtype), b.astype(dtype)
        x = mx.dequantize(w, s, b, group_size=self.group, bits=self.bits, dtype=dtype)
        if self.layout == "channel":
            return x
        B, H, nb, D, G = x.shape
        return x.swapaxes(-1, -2).reshape(B, H, nb * G, D)

    def bytes_per_token(self, n_heads: int) -> float:
        per_element = (self.bits + 2 * 8 * META_DTYPE.size / self.group) / 8
        return per_element * n_heads * self.head_dim

    def describe(self) -> dict:
        return {**self.spec.to_json(), "layout": self.layout, "block_tokens": self.block_tokens}
