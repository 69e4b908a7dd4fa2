"""Kernel inputs of 8 bytes or less (MLX's CUDA scalar pool, a page fault a kernel read) are handed over padded."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kvcore.attention import cuda_decode
from kvcore.backend import POOL_BYTES, unpooled
from kvcore.codecs import CodecSpec, make_codec
from kvcore.codecs import turbo_cuda_encode


def test_a_small_array_comes_back_padded_once_and_a_big_one_as_it_is():
    small, big = mx.array([0.25, -0.5], dtype=mx.float32), mx.arange(3, dtype=mx.float32)
    got = unpooled(small)
    assert got.nbytes > POOL_BYTES and np.array_equal(np.array(got[:2]), np.array(small))
    assert np.all(np.array(got[2:]) == 0)
    assert unpooled(small) is got  # made once
    assert unpooled(big) is big


def test_a_one_bit_turbo_codebook_reaches_the_kernels_out_of_the_pool():
    codec = make_codec(CodecSpec("turbo", 1), 128)
    assert codec.centroids.nbytes <= POOL_BYTES  # two float32 centroids: the pool's size
    side = cuda_decode._codec_side(codec, 128, True)
    assert side is not None  # the decode kernel reads this codec: its book is the padded copy
    assert side[1].nbytes > POOL_BYTES and np.array_equal(np.array(side[1][:2]), np.array(codec.centroids))
    bounds = turbo_cuda_encode._boundaries(1)
    assert bounds.nbytes <= POOL_BYTES and unpooled(bounds).nbytes > POOL_BYTES
