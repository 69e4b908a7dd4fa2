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

A prefill chunk encodes every layer's K and V, so the encode's nodes and passes are a per-chunk
cost (issue 14): up to `COUNT_BITS` the cell index is the count of boundaries below the coordinate
(what the binary search found, from comparisons with constants, no gathers), and index, centroids
and scale are one compiled function (`_quantizer`): 18 nodes per encode of a (1, 8, T, 128) chunk
where the search's gathers and selects made 63-70, the same bits (CPU: 4-bit 252 -> ~45 ms at T = 2048).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

from .base import CodecSpec, Encoded
from .bitpack import chunk_table, lookup, pack, packed_bytes
from .lloyd_max import gaussian_codebook
from . import turbo_cuda, turbo_cuda_encode
from .rotation import make_rotation

BITS = (1, 2, 3, 4, 5, 6, 7, 8)
SEED = 0
SCALE_DTYPE = mx.float16
COUNT_BITS = 5  # up to here the cell index counts boundaries (2**bits - 1 comparisons); above, binary search


def cell_index(z: mx.array, bits: int) -> mx.array:
    """z: (..., d) in N(0, 1) units -> (..., d) uint8 cells of the Lloyd–Max codebook: how many
    boundaries lie below each coordinate (numpy's searchsorted(boundaries, z, "left"))."""
    b = gaussian_codebook(bits)[1].astype(np.float32)
    bounds = [float(v) for v in b]  # exact float32 values: the same comparisons as against the array
    if bits <= COUNT_BITS:  # compared with constants and summed as a tree (a chain is too deep to fuse)
        terms = [(z > v).astype(mx.uint8) for v in bounds]
        while len(terms) > 1:
            terms = [terms[i] + terms[i + 1] if i + 1 < len(terms) else terms[i] for i in range(0, len(terms), 2)]
        return terms[0]
    boundaries = mx.array(b)
    half = 1 << (bits - 1)  # binary search; its first step without a gather (shape-free: no zeros(z.shape))
    idx = (z > bounds[half - 1]).astype(mx.uint8) * half
    for k in reversed(range(bits - 1)):
        cand = idx + (1 << k)
        idx = mx.where(z > boundaries[cand - 1], cand, idx)
    return idx


@lru_cache(maxsize=None)
def _quantizer(head_dim: int, bits: int):
    """y (..., d) float32 rotated vectors -> (cell indices (..., d) uint8, scales (..., 1) SCALE_DTYPE),
    compiled (shape-free: elementwise work, a gather and last-axis sums)."""
    centroids = mx.array(gaussian_codebook(bits)[0].astype(np.float32))

    def quantize(y: mx.array) -> tuple[mx.array, mx.array]:
        norm = mx.sqrt((y * y).sum(axis=-1, keepdims=True))  # (..., 1)
        idx = cell_index(y * (head_dim**0.5 / mx.maximum(norm, 1e-30)), bits)  # N(0, 1) units
        cv = centroids[idx]
        scale = (y * cv).sum(axis=-1, keepdims=True) / mx.maximum((cv * cv).sum(axis=-1, keepdims=True), 1e-30)
        return idx, scale.astype(SCALE_DTYPE)

    return mx.compile(quantize, shapeless=True)


class TurboCodec:
    block_tokens = 1

    def __init__(self, spec: CodecSpec, head_dim: int):
        if spec.bits not in BITS:
            raise ValueError(f"turbo bits must be one of {BITS}, got {spec.bits}")
        self.spec = spec
        self.head_dim = head_dim
        self.bits = spec.bits
        self.rotation = make_rotation(head_dim, SEED)
        c = gaussian_codebook(self.bits)[0]
        self.centroids = mx.array(c.astype("float32"))  # (2**bits,)
        self.table = chunk_table(c, self.bits)  # centroids of every chunk of packed indices

    def encode(self, x: mx.array) -> Encoded:
        """One CUDA launch where it serves (`turbo_cuda_encode`, the CUDA default: the same up to float rounding)."""
        out = turbo_cuda_encode.encode(self, x)
        return self.portable_encode(x) if out is None else out

    def encoder(self, dtype, dim: int):
        """`encode` for inputs of this dtype and head dim as one function with its checks made once (the CUDA
        launch where it serves, else None: callers fall back to `encode`)."""
        return turbo_cuda_encode.encoder(self, dtype, dim) if dim == self.head_dim else None

    def portable_encode(self, x: mx.array) -> Encoded:
        """The encode in pure MLX (the reference of the CUDA launch)."""
        idx, scale = _quantizer(self.head_dim, self.bits)(self.rotation.forward(x))  # rotated: float32
        return pack(idx, self.bits), scale  # (B, H, T, ceil(d*bits/8)) uint8, (B, H, T, 1)

    def decode(self, enc: Encoded, dtype: mx.Dtype) -> mx.array:
        return self.rotation.inverse(self._rotated(enc, mx.float32), dtype)

    def decode_rotated(self, enc: Encoded, dtype: mx.Dtype) -> mx.array:
        """R x instead of x: for attention run in the rotated basis (`kvcore.attention.rotated`)."""
        return self._rotated(enc, dtype)

    def _rotated(self, enc: Encoded, dtype: mx.Dtype) -> mx.array:
        """s c as `dtype`: one CUDA launch where it serves (`turbo_cuda`, the same values bit for bit)."""
        out = turbo_cuda.rotated(self, enc, dtype)
        return self.portable_rotated(enc).astype(dtype) if out is None else out

    def portable_decode(self, enc: Encoded, dtype: mx.Dtype) -> mx.array:
        """`decode` in pure MLX (the same values: the launch is checked bit for bit against it)."""
        return self.rotation.inverse(self.portable_rotated(enc), dtype)

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

