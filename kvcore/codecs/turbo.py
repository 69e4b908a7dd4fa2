"""TurboQuant-style codec: rotate, then one optimal scalar quantizer per coordinate.

For a head vector x of dim d (arXiv 2504.19874, the MSE variant):
1. y = R x with a fixed seeded orthogonal R (`rotation.py`): whatever the channel outliers
   of x, the coordinates of y / |y| are close to N(0, 1/d);
2. each coordinate of sqrt(d) y / |y| is quantized with the Lloyd–Max codebook of N(0, 1)
   at `bits` bits (`lloyd_max.py`), the indices bit-packed (`bitpack.py`);
3. one float16 scale per vector: the least-squares s = <y, c> / <c, c> of y ~ s c, so
   decoding is x ~ R^T (s c).
Stored per vector: ceil(d * bits / 8) bytes + 2 bytes, so bits per element are
bits + 16/d (k4v3 at d = 64: 4.25 and 3.25). One token per block: encoding is per token.
"""

from __future__ import annotations

import mlx.core as mx

from .base import CodecSpec, Encoded
from .bitpack import chunk_table, lookup, pack, packed_bytes
from .lloyd_max import gaussian_codebook
from . import turbo_cuda
from .rotation import make_rotation

BITS = (1, 2, 3, 4, 5, 6, 7, 8)
SEED = 0
SCALE_DTYPE = mx.float16


class TurboCodec:
    block_tokens = 1

    def __init__(self, spec: CodecSpec, head_dim: int):
        if spec.bits not in BITS:
            raise ValueError(f"turbo bits must be one of {BITS}, got {spec.bits}")
        self.spec = spec
        self.head_dim = head_dim
        self.bits = spec.bits
        self.rotation = make_rotation(head_dim, SEED)
        c, b = gaussian_codebook(self.bits)
        self.centroids = mx.array(c.astype("float32"))  # (2**bits,)
        self.boundaries = mx.array(b.astype("float32"))  # (2**bits - 1,)
        self.table = chunk_table(c, self.bits)  # centroids of every chunk of packed indices

    def _index(self, z: mx.array) -> mx.array:
        """z: (..., d) in N(0, 1) units -> cell index (..., d), by binary search over the boundaries."""
        idx = mx.zeros(z.shape, dtype=mx.int32)
        for k in reversed(range(self.bits)):
            cand = idx + (1 << k)
            idx = mx.where(z > self.boundaries[cand - 1], cand, idx)
        return idx

    def encode(self, x: mx.array) -> Encoded:
        d = self.head_dim
        y = self.rotation.forward(x)  # (B, H, T, d) float32
        norm = mx.sqrt((y * y).sum(axis=-1, keepdims=True))  # (B, H, T, 1)
        z = y * (d**0.5 / mx.maximum(norm, 1e-30))
        idx = self._index(z)
        c = self.centroids[idx]
        scale = (y * c).sum(axis=-1, keepdims=True) / mx.maximum((c * c).sum(axis=-1, keepdims=True), 1e-30)
        return pack(idx, self.bits), scale.astype(SCALE_DTYPE)  # (B, H, T, ceil(d*bits/8)) uint8, (B, H, T, 1)

    def decode(self, enc: Encoded, dtype: mx.Dtype) -> mx.array:
        return self.rotation.inverse(self._rotated(enc, mx.float32)).astype(dtype)

    def decode_rotated(self, enc: Encoded, dtype: mx.Dtype) -> mx.array:
        """R x instead of x: for attention run in the rotated basis (`kvcore.attention.rotated`)."""
        return self._rotated(enc, dtype)

    def _rotated(self, enc: Encoded, dtype: mx.Dtype) -> mx.array:
        """s c as `dtype`: one CUDA launch where it serves (`turbo_cuda`, the same values bit for bit)."""
        out = turbo_cuda.rotated(self, enc, dtype)
        return self.portable_rotated(enc).astype(dtype) if out is None else out

    def portable_rotated(self, enc: Encoded) -> mx.array:
        """s c in float32, in pure MLX (the reference of the CUDA launch)."""
        packed, scale = enc
        c = lookup(packed, self.table, self.bits, self.head_dim)  # (B, H, T, d) centroids
        return c * scale.astype(mx.float32)

    def bytes_per_token(self, n_heads: int) -> float:
        return n_heads * (packed_bytes(self.head_dim, self.bits) + SCALE_DTYPE.size)

    def describe(self) -> dict:
        rot = "hadamard" if self.rotation.signs is not None else "qr"
        return {**self.spec.to_json(), "rotation": rot, "seed": SEED, "block_tokens": 1}

