"""Affine (min/max) integer quantization, mlx-lm compatible where head_dim allows.

Two layouts, picked from head_dim:
- "channel": groups of `group_size` along head_dim, one token at a time (mlx-lm's layout).
- "token": for head dims that `group_size` does not divide (stories260K has 8, Phi 80),
  each channel is grouped over `group_size` consecutive tokens (as KIVI does for keys),
  so no padding is stored. A block then holds `group_size` tokens.

Scales and biases are stored as float16 whatever the run dtype: 2 bytes each, which is what
a float16/bfloat16 deployment pays, so bytes per element are (bits + 32/group) / 8.
"""

from __future__ import annotations

import mlx.core as mx

from .base import CodecSpec, Encoded

BITS = (2, 3, 4, 5, 6, 8)
GROUPS = (32, 64, 128)
META_DTYPE = mx.float16


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
