"""TurboQuant's rotated-basis decode in one CUDA launch (kvcore/codecs/turbo_cuda.py): bit for bit the
portable decode for every bit width, head dim and output dtype, read through strided slices; the
codec's decodes equal the portable ones on CUDA; off CUDA the launch never serves."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kvcore.backend import backend_name
from kvcore.codecs import CodecSpec
from kvcore.codecs import turbo_cuda
from kvcore.codecs.turbo import TurboCodec

ON_CUDA = backend_name() == "cuda"
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="the CUDA kernels run on the CUDA backend only")


@cuda_only
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
def test_turbo_decode_kernel_is_the_portable_decode_bit_for_bit(bits):
    for dim in (64, 128, 256):
        codec = TurboCodec(CodecSpec("turbo", bits), dim)
        for dtype in turbo_cuda.DTYPES:
            assert turbo_cuda.check(codec, dtype) is None, (dim, dtype)
            assert turbo_cuda.admitted(codec, dtype), turbo_cuda.status()


@cuda_only
@pytest.mark.parametrize("bits", [3, 4])
def test_codec_decodes_on_cuda_equal_the_portable_ones(bits):
    """What attention reads (decode_rotated) and the inverse-rotated decode, from a cache-like buffer's slice."""
    codec = TurboCodec(CodecSpec("turbo", bits), 128)
    x = mx.random.normal((1, 8, 300, 128), key=mx.random.key(7)).astype(mx.bfloat16)
    packed, scale = codec.encode(x)
    enc = (packed[:, :, 10:290], scale[:, :, 10:290])
    portable = codec.portable_rotated(enc)
    assert mx.array_equal(codec.decode_rotated(enc, mx.bfloat16), portable.astype(mx.bfloat16)).item()
    want = codec.rotation.inverse(portable).astype(mx.bfloat16)
    assert mx.array_equal(codec.decode(enc, mx.bfloat16), want).item()


def test_off_cuda_the_launch_never_serves():
    if ON_CUDA:
        pytest.skip("on CUDA the launch serves")
    codec = TurboCodec(CodecSpec("turbo", 3), 128)
    enc = codec.encode(mx.random.normal((1, 2, 5, 128), key=mx.random.key(1)))
    assert turbo_cuda.rotated(codec, enc, mx.bfloat16) is None
    assert mx.array_equal(codec.decode_rotated(enc, mx.float32), codec.portable_rotated(enc)).item()
