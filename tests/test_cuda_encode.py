"""The one-launch decode-step encode (kvcore/attention/cuda_encode.py) and the decode kernel that
merges its own splits: bit for bit the portable encode, the same attention as two launches; off
CUDA neither serves and the portable paths are unchanged."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvcore.attention import cuda_decode, cuda_encode, cuda_kernels
from kvcore.attention.config import AttentionConfig
from kvcore.attention.cuda_check import check_inputs, relative_error
from kvcore.attention.cuda_launch import Plan, Side
from kvcore.backend import backend_name
from kvcore.cache import CompressedKVCache
from kvcore.codecs import CodecSpec

ON_CUDA = backend_name() == "cuda"
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="the CUDA kernels run on the CUDA backend only")


@cuda_only
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_encode_kernel_is_the_portable_encode_bit_for_bit(bits):
    """Words, float16 scales and biases equal `AffineCodec.encode` of the concatenated K/V, for
    every group and head dim and each input dtype (zero, one-sided, shifted and constant groups)."""
    cases = [(64, d, t) for d in (64, 128, 256) for t in (mx.bfloat16, mx.float16, mx.float32)]
    if bits == 4:  # the other groups (each group size is its own compiled kernel)
        cases += [(g, 128, t) for g in (32, 128) for t in (mx.bfloat16, mx.float32)]
    for group, dim, dtype in cases:
        assert cuda_encode.check(bits, group, dim, dtype) is None, (group, dim, dtype)


def _decode_steps(cuda: bool, bits: int, steps: int = 6):
    mx.random.seed(bits)
    att = AttentionConfig(cuda_kernel=cuda, cuda_min_tokens=0)
    cache = CompressedKVCache(CodecSpec("affine", bits, 64), start=0, attention=att)
    cache.update_and_fetch(*(mx.random.normal((1, 2, 40, 128)).astype(mx.bfloat16) for _ in range(2)))
    for _ in range(steps):  # one token a step: the joint encode (the kernel where it serves)
        k, v = (mx.random.normal((1, 2, 1, 128)).astype(mx.bfloat16) for _ in range(2))
        cache.update_and_fetch(k, v)
    mx.eval(cache.state)
    return cache


@pytest.mark.parametrize("bits", [4, 8])
def test_a_cache_stores_the_same_bits_with_the_kernel_on_or_off(bits):
    """End to end through the cache: the decode steps' stored K/V are identical either way."""
    on, off = _decode_steps(True, bits), _decode_steps(False, bits)
    assert len(on.state) == len(off.state)
    for a, b in zip(on.state, off.state):
        view = (lambda x: x.view(mx.uint16)) if a.dtype == mx.float16 else (lambda x: x)
        assert a.dtype == b.dtype and np.array_equal(np.array(view(a)), np.array(view(b)))
    k, v = mx.zeros((1, 2, 1, 128)), mx.zeros((1, 2, 1, 128))
    assert (cuda_encode.encode_joint(on.key_codec, k, v) is not None) is ON_CUDA  # the kernel serves on CUDA only


@cuda_only
@pytest.mark.parametrize("plan", [
    Plan(Side("affine", 4, 64, 128), Side("affine", 4, 64, 128), 4, 1),
    Plan(Side("affine", 8, 64, 128), Side("affine", 3, 32, 128), 8, 1),
    Plan(Side("affine", 4, 32, 64), Side("affine", 4, 32, 64), 1, 5),
    Plan(Side("turbo", 4, 128, 128), Side("turbo", 3, 128, 128), 4, 1),
    Plan(Side.dense("bfloat16", 128), Side.dense("bfloat16", 128), 4, 2),
], ids=cuda_decode.describe)
@pytest.mark.parametrize("q_dtype", [mx.float32, mx.bfloat16])
def test_the_kernel_merging_its_splits_equals_the_two_launches(plan, q_dtype):
    """One launch (the last block of each row, head and query chunk merges) == kernel + merge kernel,
    with sinks, uneven rows, bounds and strided buffers; both within the device check's tolerance."""
    q, launch, ref, sinks, scale, split = check_inputs(plan, q_dtype, seed=3)
    two = cuda_kernels.merge(q, [cuda_kernels.partials(q, launch, plan, scale, 2, split)], plan.rep,
                            plan.value.dim, sinks)
    for _ in range(3):  # the counters are left at zero for the next launch: the same answer again
        one = cuda_kernels.partials(q, launch, plan, scale, 2, split, sinks=sinks, fused=True)[3]
        assert relative_error(one, two) < (1e-6 if q_dtype == mx.float32 else 4e-3)  # bfloat16: an ulp at most
    assert relative_error(one, ref) < {mx.float32: 1e-4, mx.bfloat16: 1.5e-2}[q_dtype]
    assert not mx.any(cuda_kernels._counters()).item()


def test_encode_lanes_per_word_or_per_group():
    """Codes that divide a word get a lane per output word (its group's min and max shared by
    shuffles); others a lane per group. One decode token of llama-8b's 8 KV heads x 128 at 4 bits:
    2 x 8 heads x 2 groups x 8 words = 256 lanes (32 before)."""
    assert cuda_encode.lanes(1, 8, 1, 128, 4, 64) == 256
    assert cuda_encode.lanes(2, 8, 3, 128, 8, 32) == 2 * 16 * 3 * 4 * 8
    assert cuda_encode.lanes(1, 8, 1, 128, 3, 64) == 32  # 3-bit codes straddle words
    assert "__shfl_xor_sync" in cuda_encode.source_for(4) and "__shfl_xor_sync" not in cuda_encode.source_for(3)
    for bits in (2, 4, 8):
        assert (64 * bits) % 32 == 0 and cuda_encode.source_for(bits) is cuda_encode.WORD_SOURCE
