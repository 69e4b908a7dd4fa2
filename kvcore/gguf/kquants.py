"""Exact decoders for the K-quant types mx.load gets wrong or only approximates.

mlx 0.32.4's mx.load decodes Q4_K/Q6_K through gguflib into float16; its Q4_K
path is wrong (the odd sub-block of each pair reuses the even one's scale/min),
so we re-decode these tensors from the raw bytes (layouts: ggml-common.h):
- Q4_K: 256-element super-blocks of 8 sub-blocks of 32, w = d*sc*q - dmin*m;
  that is exactly MLX affine 4-bit with group 32, so it stays quantized.
- Q6_K: 16 sub-blocks of 16, w = d*sc*(q - 32); MLX has no group 16, so it
  is decoded dense (float32, exact).
"""

from __future__ import annotations

import numpy as np

_Q4K = np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qs", "u1", 128)])
_Q6K = np.dtype([("ql", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16), ("d", "<f2")])


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """s: (nb, 12) packed 6-bit scales/mins -> sc, m: (nb, 8)."""
    s = s.astype(np.uint32)
    sc = np.empty((len(s), 8), np.uint32)
    m = np.empty_like(sc)
    sc[:, :4], m[:, :4] = s[:, 0:4] & 63, s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)
    m[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, m


def q4_k_affine(raw: np.ndarray, shape: tuple[int, ...]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K bytes -> MLX affine (packed uint32, scales, biases float32), group 32.

    shape: (rows, cols) with cols % 256 == 0. Returns w (rows, cols/8),
    scales and biases (rows, cols/32).
    """
    rows, cols = shape
    b = raw.view(_Q4K)  # (nb,) super-blocks, row-major
    sc, m = _scale_min_k4(b["scales"])
    scales = b["d"].astype(np.float32)[:, None] * sc  # (nb, 8)
    biases = -(b["dmin"].astype(np.float32)[:, None] * m)
    qs = b["qs"].reshape(-1, 4, 32)  # 4 chunks of 32 bytes -> sub-blocks 2c (low), 2c+1 (high)
    q = np.stack([qs & 15, qs >> 4], axis=2).reshape(-1, 256).astype(np.uint32)  # (nb, 256)
    q = q.reshape(rows, cols // 8, 8)
    packed = np.zeros((rows, cols // 8), np.uint32)
    for i in range(8):  # MLX: element i of each word at bits 4*i
        packed |= q[:, :, i] << np.uint32(4 * i)
    return packed, scales.reshape(rows, cols // 32), biases.reshape(rows, cols // 32)


def q6_k_dense(raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Q6_K bytes -> float32 array of `shape` (exact)."""
    b = raw.view(_Q6K)
    ql = b["ql"].reshape(-1, 2, 64).astype(np.int32)  # two halves of 128 weights
    qh = b["qh"].reshape(-1, 2, 32).astype(np.int32)
    # within a half: weights l, l+32, l+64, l+96 (l < 32) use (ql[l], ql[l+32]) low/high
    # nibbles and bit pairs 0, 2, 4, 6 of qh[l]
    q = np.stack([
        (ql[:, :, :32] & 15) | ((qh >> 0) & 3) << 4,
        (ql[:, :, 32:] & 15) | ((qh >> 2) & 3) << 4,
        (ql[:, :, :32] >> 4) | ((qh >> 4) & 3) << 4,
        (ql[:, :, 32:] >> 4) | ((qh >> 6) & 3) << 4,
    ], axis=2) - 32  # (nb, 2, 4, 32)
    sc = b["scales"].astype(np.float32).reshape(-1, 2, 4, 2)  # 16-element sub-blocks
    d = b["d"].astype(np.float32)[:, None, None, None]
    w = q.reshape(-1, 2, 4, 2, 16) * (d * sc)[..., None]
    return w.reshape(shape).astype(np.float32)
