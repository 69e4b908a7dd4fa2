"""Attention in a rotation codec's basis == the plain path (decode with the inverse rotation)."""

import mlx.core as mx
import pytest

from kvcore.attention import batch_kv_attention, blockwise, kv_attention
from kvcore.attention.config import AttentionConfig
from kvcore.attention.rotated import in_rotated_basis, shared_rotation
from kvcore.cache import BatchCompressedKVCache, CompressedKVCache
from kvcore.cache.packed import PackedView
from kvcore.cache.paged import PagedView
from kvcore.codecs import CodecSpec

K4, V3 = CodecSpec("turbo", 4, None), CodecSpec("turbo", 3, None)
CASES = [
    # head_dim (64: Hadamard, 48: QR rotation), window, keep, recent, sinks
    (64, None, 0, 0, False),
    (48, None, 0, 5, True),
    (64, 40, 4, 0, True),
    (64, 48, 2, 3, False),
]


def close(a, b, tol=3e-5):
    return mx.allclose(a, b, atol=tol, rtol=1e-4).item()


@pytest.mark.parametrize("block", [None, 32], ids=["fused", "blockwise"])
@pytest.mark.parametrize("head_dim,window,keep,recent,sinks", CASES)
def test_rotated_basis_equals_plain_path(head_dim, window, keep, recent, sinks, block):
    mx.random.seed(7)
    cache = CompressedKVCache(K4, V3, start=3, window=window, keep=keep, recent=recent,
                              attention=AttentionConfig(block=block))
    Hq, Hkv, rotated = 6, 2, 0
    sink = mx.random.normal((Hq,)) if sinks else None
    for N in (5, 1, 70, 1, 33, 1, 130, 1):
        k, v = mx.random.normal((2, Hkv, N, head_dim)), mx.random.normal((2, Hkv, N, head_dim))
        q = mx.random.normal((2, Hq, N, head_dim))
        view, _ = cache.update_and_fetch(k, v)
        rotated += shared_rotation(view) is not None
        fast = in_rotated_basis(kv_attention, q, view, head_dim**-0.5, sink)
        assert close(fast, kv_attention(q, view, head_dim**-0.5, sink)), N
    assert rotated >= 7  # every update after the conversion start took the rotated path


def test_rotated_basis_in_bfloat16_stays_within_rounding():
    mx.random.seed(8)
    cache = CompressedKVCache(K4, K4, start=0, recent=4)
    k, v = (mx.random.normal((1, 2, 300, 128)).astype(mx.bfloat16) for _ in range(2))
    cache.update_and_fetch(k, v)
    q = mx.random.normal((1, 8, 1, 128)).astype(mx.bfloat16)
    view, _ = cache.update_and_fetch(k[:, :, :1], v[:, :, :1])
    fast = in_rotated_basis(kv_attention, q, view, 128**-0.5, None)
    ref = kv_attention(q.astype(mx.float32), view, 128**-0.5, None)  # float32 reference of the same view
    assert fast.dtype == mx.bfloat16 and close(fast.astype(mx.float32), ref, tol=3e-2)


@pytest.mark.parametrize("block", [None, 32], ids=["stacked-or-packed", "per-row"])
def test_rotated_basis_over_batch_rows(block):
    """Rows of different lengths and windows (a BatchKVView) and packed rows (a PackedView)."""
    mx.random.seed(9)
    cfg = AttentionConfig(block=block)
    for windows in ((None, 64, 48), (None, None, None)):  # windows: row by row; none: packed rows
        rows = [CompressedKVCache(K4, V3, start=0, window=w, keep=2 if w else 0, attention=cfg) for w in windows]
        for r, n in zip(rows, (10, 50, 90)):
            r.update_and_fetch(mx.random.normal((1, 2, n, 64)), mx.random.normal((1, 2, n, 64)))
        batch = BatchCompressedKVCache(rows)
        q = mx.random.normal((3, 4, 1, 64))
        view, _ = batch.update_and_fetch(mx.random.normal((3, 2, 1, 64)), mx.random.normal((3, 2, 1, 64)))
        packed = windows[1] is None
        assert isinstance(view, (PackedView, PagedView)) == packed and shared_rotation(view) is not None
        attend = blockwise.packed_attention if packed else batch_kv_attention
        assert close(in_rotated_basis(attend, q, view, 0.125, None), attend(q, view, 0.125, None))


def test_other_codecs_attend_as_usual():
    for key, value in ((CodecSpec("affine", 4, 32), CodecSpec("affine", 4, 32)), (K4, CodecSpec("affine", 4, 32)),
                       (CodecSpec("full"), CodecSpec("full"))):
        cache = CompressedKVCache(key, value, start=0)
        view, _ = cache.update_and_fetch(mx.random.normal((1, 2, 9, 64)), mx.random.normal((1, 2, 9, 64)))
        assert shared_rotation(view) is None
