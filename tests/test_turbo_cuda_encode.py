"""TurboQuant's one-launch encode (kvcore/codecs/turbo_cuda_encode.py): on CPU, the kernel's arithmetic emulated
lane by lane in float32 (the butterflies in its order, its in-lane sums then the shuffle tree, its shared-memory
bit assembly) against the portable encode, through the same comparison the device admission makes, with wrong
variants as negative controls; on CUDA, the launch itself."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from kvcore.backend import backend_name
from kvcore.codecs import CodecSpec, turbo_cuda_encode
from kvcore.codecs.bitpack import pack
from kvcore.codecs.lloyd_max import gaussian_codebook
from kvcore.codecs.turbo import TurboCodec

f32 = np.float32


def _warp_sum(parts: np.ndarray) -> np.ndarray:
    """(..., 32) lane partials -> (...,) the xor-shuffle tree's result (every lane ends with it; lane 0's)."""
    p = parts.astype(f32)
    for m in (16, 8, 4, 2, 1):
        p = (p + p[..., np.arange(32) ^ m]).astype(f32)
    return p[..., 0]


def emulate(x: np.ndarray, codec: TurboCodec, order: str = "natural") -> tuple[np.ndarray, np.ndarray]:
    """x (V, D) float32 -> (packed (V, D * bits / 8) uint8, scale (V, 1) float16) as the kernel computes them."""
    V, D = x.shape
    epl, bits = D // 32, codec.bits
    signs = np.array(codec.rotation.signs, dtype=f32)
    y = (x.astype(f32) * signs).astype(f32)
    stages = [1 << k for k in range(int(math.log2(D)))]
    for h in (stages if order == "natural" else stages[::-1]):  # element i pairs with i ^ h
        i = np.arange(D)
        lower = (i & h) == 0
        partner = y[:, i ^ h]
        y = np.where(lower, y + partner, partner - y).astype(f32)
    y = (y * f32(1 / math.sqrt(D))).astype(f32)
    lanes = lambda a: a.reshape(V, 32, epl)  # lane l holds elements [epl l, epl l + epl)

    def lane_sum(a):
        acc = np.zeros((V, 32), dtype=f32)
        for e in range(epl):
            acc = (acc + lanes(a)[:, :, e]).astype(f32)
        return _warp_sum(acc)

    ss = lane_sum(y * y)
    f = (f32(math.sqrt(D)) / np.maximum(np.sqrt(ss).astype(f32), f32(1e-30))).astype(f32)
    z = (y * f[:, None]).astype(f32)
    bounds = gaussian_codebook(bits)[1].astype(f32)
    idx = np.searchsorted(bounds, z, side="left")  # how many boundaries lie below z
    c = gaussian_codebook(bits)[0].astype(f32)[idx]
    dot, cc = lane_sum(y * c), lane_sum(c * c)
    scale = (dot / np.maximum(cc, f32(1e-30))).astype(f32).astype(np.float16)[:, None]
    words = np.zeros((V, (D * bits + 31) // 32), dtype=np.uint64)  # the shared-memory bit assembly
    for i in range(D):
        o = i * bits
        w, sh = o >> 5, o & 31
        words[:, w] |= (idx[:, i].astype(np.uint64) << np.uint64(sh)) & np.uint64(0xFFFFFFFF)
        if sh + bits > 32:
            words[:, w + 1] |= idx[:, i].astype(np.uint64) >> np.uint64(32 - sh)
    nby = D * bits // 8
    j = np.arange(nby)
    packed = ((words[:, j >> 2] >> (8 * (j & 3)).astype(np.uint64)) & np.uint64(255)).astype(np.uint8)
    assert np.array_equal(packed, np.array(pack(mx.array(idx.astype(np.uint8)), bits)))  # pack's layout exactly
    return packed, scale


def _vectors(d: int, seed: int) -> np.ndarray:
    r = np.random.default_rng(seed).standard_normal((600, d)).astype(f32)
    r[:200] *= 30
    r[200:300] *= 0.01
    r[300, :] = 0
    r[301, :] = 0.75
    r[302, 5] = 1e4  # an outlier channel
    return r


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_the_kernel_arithmetic_is_the_portable_encode_up_to_rounding(bits, d):
    codec = TurboCodec(CodecSpec("turbo", bits), d)
    x = _vectors(d, bits * 7 + d)
    got = tuple(mx.array(a)[None, None] for a in emulate(x, codec))
    want = codec.portable_encode(mx.array(x)[None, None])
    assert turbo_cuda_encode.compare(got, want, bits, d) is None


@pytest.mark.parametrize("bits", [3, 4])
def test_the_comparison_refuses_a_wrong_transform_or_scale(bits):
    codec = TurboCodec(CodecSpec("turbo", bits), 128)
    x = _vectors(128, 3)
    want = codec.portable_encode(mx.array(x)[None, None])
    packed, scale = emulate(x, codec, order="reversed")  # the stages in another order: the same transform, rounded
    assert turbo_cuda_encode.compare((mx.array(packed)[None, None], mx.array(scale)[None, None]), want, bits, 128) is None
    wrong = TurboCodec(CodecSpec("turbo", bits), 128)  # the signs flipped: another rotation
    object.__setattr__(wrong, "rotation", type(codec.rotation)(128, -codec.rotation.signs, None))
    bad = tuple(mx.array(a)[None, None] for a in emulate(x, wrong))
    assert "differs" in turbo_cuda_encode.compare(bad, want, bits, 128)
    packed, scale = emulate(x, codec)
    off = scale.copy()
    off[7] = (off[7].view(np.uint16) + 2).view(np.float16)  # one scale two float16 steps off
    assert "2 float16 steps" in turbo_cuda_encode.compare((mx.array(packed)[None, None], mx.array(off)[None, None]),
                                                           want, bits, 128)


def test_the_launch_serves_only_where_asked_and_covered(monkeypatch):
    codec = TurboCodec(CodecSpec("turbo", 4), 128)
    x = mx.random.normal((1, 2, 3, 128))
    monkeypatch.setenv("MLXKV_CUDA_TURBO_ENCODE", "0")
    assert turbo_cuda_encode.encode(codec, x) is None  # the knob turns it off
    monkeypatch.delenv("MLXKV_CUDA_TURBO_ENCODE", raising=False)  # on by default
    qr = TurboCodec(CodecSpec("turbo", 4), 96)  # not a power of two: a QR rotation, the portable encode
    assert turbo_cuda_encode.encode(qr, mx.random.normal((1, 2, 3, 96))) is None
    if backend_name() != "cuda":
        assert turbo_cuda_encode.encode(codec, x) is None
        assert all(a.tolist() == b.tolist() for a, b in zip(codec.encode(x), codec.portable_encode(x)))


def test_a_cache_checks_its_turbo_encoder_once_and_launches_it_each_step(monkeypatch):
    """A TurboQuant layer's decode steps encode K and V through the launch with the checks made once per side for
    the cache (`turbo_cuda_encode.encoder`, kept in the cache's memo), not once per step; its state is what the
    per-call `encode` stores. "CUDA" here: the backend named so and a launch that returns the portable encode."""
    from kvcore.cache import CompressedKVCache

    checks, launches = [], []
    monkeypatch.setattr(turbo_cuda_encode, "backend_name", lambda: "cuda")
    monkeypatch.setattr(turbo_cuda_encode, "admitted", lambda codec, dtype: checks.append(codec.bits) or True)
    monkeypatch.setattr(turbo_cuda_encode, "launch", lambda x, codec: launches.append(codec.bits) or codec.portable_encode(x))
    mx.random.seed(3)
    cache = CompressedKVCache(CodecSpec("turbo", 4), CodecSpec("turbo", 3), start=0)
    cache.update_and_fetch(mx.random.normal((1, 2, 40, 128)), mx.random.normal((1, 2, 40, 128)))
    first = len(launches)
    steps = [(mx.random.normal((1, 2, 1, 128)), mx.random.normal((1, 2, 1, 128))) for _ in range(5)]
    for k, v in steps:
        cache.update_and_fetch(k, v)
    assert sorted(checks) == [3, 4] and launches[first:] == [4, 3] * 5  # one check per side, a launch per step
    ks, vs = cache._split_enc()
    for i, (k, v) in enumerate(steps):  # each step's cells and scales: the portable encode's
        for got, want in zip((*ks, *vs), (*cache.key_codec.portable_encode(k), *cache.value_codec.portable_encode(v))):
            assert mx.array_equal(got[:, :, 40 + i : 41 + i], want).item()
    monkeypatch.setenv("MLXKV_CUDA_TURBO_ENCODE", "0")  # a new cache sees the knob (the kept encoder is per cache)
    other = CompressedKVCache(CodecSpec("turbo", 4), CodecSpec("turbo", 3), start=0)
    n = len(launches)
    other.update_and_fetch(*steps[0])
    assert len(launches) == n


@pytest.mark.skipif(backend_name() != "cuda", reason="the real kernel runs on the CUDA backend only")
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_the_launch_is_the_portable_encode_on_the_device(monkeypatch, bits, d, dtype):
    monkeypatch.setenv("MLXKV_CUDA_TURBO_ENCODE", "1")
    codec = TurboCodec(CodecSpec("turbo", bits), d)
    assert turbo_cuda_encode.check(codec, getattr(mx, dtype)) is None
    x = mx.array(_vectors(d, bits + d)).reshape(2, 3, 100, d).astype(getattr(mx, dtype))
    got, want = codec.encode(x), codec.portable_encode(x)
    assert turbo_cuda_encode.compare(got, want, bits, d) is None
    dec = codec.decode(got, mx.float32)  # and it decodes as well as the portable encode does
    err = lambda e: (mx.linalg.norm(e - x.astype(mx.float32)) / mx.linalg.norm(x.astype(mx.float32))).item()
    assert err(dec) <= err(codec.decode(want, mx.float32)) * 1.001 + 1e-6
