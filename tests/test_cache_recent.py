"""`recent`: each query reads the r tokens before it (and itself) at full precision, older ones
encoded, whatever the chunking; rollback keeps that exact."""

import mlx.core as mx
import pytest

from kvcore.attention.blockwise import kv_attention, reference_attention
from kvcore.cache import CompressedKVCache
from kvcore.codecs import CodecSpec, make_codec

SPECS = [CodecSpec("turbo", 2), CodecSpec("affine", 2, 32)]  # coarse codecs: any mix-up shows
D, H, T = 64, 2, 48


def _expected(q, k, v, q_start, r, codec):
    """Reference: key/value j as stored for query i is exact when i - j <= r, else decoded
    (r = 0: every token decoded, its own too, as mlx-lm's quantized cache does)."""
    kq, vq = codec.decode(codec.encode(k), mx.float32), codec.decode(codec.encode(v), mx.float32)
    outs = []
    for n in range(q.shape[2]):
        i = q_start + n
        exact = (mx.arange(i + 1) >= (i - r if r else i + 1))[None, None, :, None]
        ks = mx.where(exact, k[:, :, : i + 1], kq[:, :, : i + 1])
        vs = mx.where(exact, v[:, :, : i + 1], vq[:, :, : i + 1])
        outs.append(reference_attention(q[:, :, n : n + 1], ks, vs, 0.125))
    return mx.concatenate(outs, axis=2)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label())
@pytest.mark.parametrize("r,chunks", [(5, [7, 1, 1, 13, 18, 8]), (1, [1] * 6 + [42]), (16, [30, 2, 16]),
                                      (0, [5, 43])])
def test_queries_read_the_recent_tokens_dense(spec, r, chunks):
    mx.random.seed(0)
    k, v, q = (mx.random.normal((1, H, T, D)) for _ in range(3))
    c = CompressedKVCache(spec, start=0, recent=r)
    codec = make_codec(spec, D)
    pos = 0
    for n in chunks:
        view, _ = c.update_and_fetch(k[:, :, pos : pos + n], v[:, :, pos : pos + n])
        got = kv_attention(q[:, :, pos : pos + n], view, 0.125)
        want = _expected(q[:, :, pos : pos + n], k, v, pos, r, codec)
        assert mx.allclose(got, want, atol=1e-5).item(), (r, pos, n)
        pos += n
    assert c.tail.n == min(r, T) and c.enc.n == T - min(r, T)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label())
def test_rollback_restores_the_recent_tokens_exactly(spec):
    """Trim after a multi-token update (a speculative verify) equals never having fed the rest."""
    mx.random.seed(1)
    k, v, q = (mx.random.normal((1, H, T, D)) for _ in range(3))
    a, b = CompressedKVCache(spec, start=0, recent=4), CompressedKVCache(spec, start=0, recent=4)
    a.update_and_fetch(k[:, :, :30], v[:, :, :30])
    a.update_and_fetch(k[:, :, 30:36], v[:, :, 30:36])
    assert a.trim(5) == 5 and a.offset == 31
    b.update_and_fetch(k[:, :, :31], v[:, :, :31])
    assert a.tail.n == b.tail.n == 4 and a.tail_start == b.tail_start
    for x, y in zip(a.state, b.state):
        assert mx.array_equal(x, y).item()
    va, _ = a.update_and_fetch(k[:, :, 31:40], v[:, :, 31:40])
    vb, _ = b.update_and_fetch(k[:, :, 31:40], v[:, :, 31:40])
    assert mx.array_equal(kv_attention(q[:, :, 31:40], va, 0.125), kv_attention(q[:, :, 31:40], vb, 0.125)).item()


def test_recent_survives_the_state_protocol():
    spec = CodecSpec("turbo", 3)
    a = CompressedKVCache(spec, start=0, window=40, keep=2, recent=6)
    a.update_and_fetch(mx.random.normal((1, H, 30, D)), mx.random.normal((1, H, 30, D)))
    b = CompressedKVCache.from_state(a.state, a.meta_state)
    assert b.layout() == a.layout() and b.recent == 6 and b.describe()["recent"] == 6
