"""Delayed conversion: streaming (one layer at a time) bounds the transient memory."""

import mlx.core as mx

from kvcore.backend import backend_name
from kvcore.cache import CompressedKVCache
from kvcore.codecs import CodecSpec
from kvcore.engine import convert_due

LAYERS, SHAPE = 8, (1, 8, 2048, 128)  # 8 MiB per K (float32), 16 MiB per layer


def _filled():
    caches = [CompressedKVCache(CodecSpec("affine", 8, 64), start=SHAPE[2]) for _ in range(LAYERS)]
    for c in caches:
        c.update_and_fetch(mx.random.normal(SHAPE), mx.random.normal(SHAPE))
        mx.eval(c.state)
    return caches


def _transient(convert) -> tuple[int, list]:
    caches = _filled()
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    convert(caches)
    return mx.get_peak_memory() - base, caches


def _all_at_once(caches):
    for c in caches:
        c.convert(piece=1 << 30)  # each layer whole and lazy: nothing evaluated between layers
    mx.eval([c.state for c in caches])


def test_streaming_conversion_transient_is_one_layer():
    layer_dense = 2 * 4 * SHAPE[0] * SHAPE[1] * SHAPE[2] * SHAPE[3]
    streaming, caches = _transient(convert_due)
    assert all(c.converted for c in caches)
    # about one layer's dense + encoded copy in flight; on CUDA 1.13 layers (H200; why is not yet measured:
    # 1 024-token conversion pieces made it 1.41, so it is not one encode call's temporaries)
    assert streaming <= layer_dense * (1.2 if backend_name() == "cuda" else 1.0)
    batch, _ = _transient(_all_at_once)
    assert batch > layer_dense  # the bound can fail: all layers at once exceed it (1.23 layers)
    # after conversion the cache holds the 8-bit encoding only
    assert caches[0].nbytes <= layer_dense * (8 + 32 / 64) / 32
