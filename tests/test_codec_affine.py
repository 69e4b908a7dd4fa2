"""Affine codec: error bounds, layouts, byte arithmetic checked against nbytes."""

import mlx.core as mx
import pytest

from kvcore.cache import CompressedKVCache
from kvcore.codecs import CodecSpec, make_codec


@pytest.mark.parametrize("head_dim,layout", [(64, "channel"), (128, "channel"), (8, "token"), (80, "token")])
@pytest.mark.parametrize("bits", [4, 8])
def test_roundtrip_error_within_one_step(head_dim, layout, bits):
    mx.random.seed(1)
    codec = make_codec(CodecSpec("affine", bits, 32 if head_dim != 80 else 64), head_dim)
    assert codec.layout == layout
    x = mx.random.normal((2, 3, 128, head_dim))
    y = codec.decode(codec.encode(x), mx.float32)
    assert y.shape == x.shape
    # per group: |x - y| <= one step (MLX snaps the bias so 0 is exact) + float16 rounding
    G = codec.group
    if layout == "channel":
        g = x.reshape(2, 3, 128, head_dim // G, G)
    else:
        g = x.reshape(2, 3, 128 // G, G, head_dim).swapaxes(-1, -2)
    step = (g.max(-1) - g.min(-1)) / (2**bits - 1)
    err = mx.abs(x - y)
    if layout == "channel":
        err = err.reshape(g.shape).max(-1)
    else:
        err = err.reshape(2, 3, 128 // G, G, head_dim).swapaxes(-1, -2).max(-1)
    assert mx.all(err <= step + 2e-3 * (1 + mx.abs(g).max(-1))).item()


def test_channel_layout_matches_mlx_quantize():
    x = mx.random.normal((1, 2, 16, 64))
    codec = make_codec(CodecSpec("affine", 4, 64), 64)
    w, s, b = mx.quantize(x, group_size=64, bits=4)
    # scales and biases are stored as float16, then widened before dequantizing
    s, b = (x.astype(mx.float16).astype(mx.float32) for x in (s, b))
    ref = mx.dequantize(w, s, b, group_size=64, bits=4)
    assert mx.array_equal(codec.decode(codec.encode(x), mx.float32), ref)


@pytest.mark.parametrize("head_dim", [8, 64, 80])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_stored_bytes_per_element_bound(head_dim, group):
    """At 4 bits: bytes per element <= (4 + 32/group)/8, metadata included, from nbytes."""
    if head_dim == 80 and group == 128:
        group = 64
    c = CompressedKVCache(CodecSpec("affine", 4, group), start=0)
    T = 512
    for i in range(0, T, 64):
        c.update_and_fetch(mx.random.normal((1, 4, 64, head_dim)), mx.random.normal((1, 4, 64, head_dim)))
    assert c.offset == T and c.size() == T
    per_element = c.nbytes / (2 * T * 4 * head_dim)
    assert per_element <= (4 + 32 / group) / 8
    assert c.nbytes > 0.9 * (2 * T * 4 * head_dim) * (4 + 32 / group) / 8


def test_fixed_input_gives_identical_encoding():
    x = mx.random.normal((1, 2, 64, 8))
    codec = make_codec(CodecSpec("affine", 3, 32), 8)
    a, b = codec.encode(x), codec.encode(x)
    assert all(mx.array_equal(p, q) for p, q in zip(a, b))
