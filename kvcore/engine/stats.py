"""KV memory figures over a cache list (mlx-lm caches and ours)."""

from __future__ import annotations

import mlx.core as mx

from ..cache import BatchCompressedKVCache, CompressedKVCache


def _elements(c) -> int:
    """Logical K+V elements stored by one layer's cache (0 for non-attention state)."""
    if isinstance(c, (CompressedKVCache, BatchCompressedKVCache)):
        return c.elements
    keys = getattr(c, "keys", None)
    if not isinstance(keys, mx.array) or not hasattr(c, "size"):
        return 0
    B, H, _, D = keys.shape
    return int(c.size()) * B * H * (D + c.values.shape[-1])


def _used_bytes(c) -> int:
    """Bytes of stored tokens (mlx-lm's caches preallocate in steps of 256; spare not counted)."""
    if isinstance(c, (CompressedKVCache, BatchCompressedKVCache)):
        return c.nbytes
    keys = getattr(c, "keys", None)
    if _elements(c) and isinstance(keys, mx.array):
        return (keys.nbytes + c.values.nbytes) * _elements(c) // (keys.size + c.values.size)
    try:
        return int(c.nbytes)
    except (NotImplementedError, AttributeError, TypeError):
        return 0


def kv_bytes(caches: list) -> int:
    return sum(_used_bytes(c) for c in caches)


def _rows(c) -> list:
    if isinstance(c, BatchCompressedKVCache):
        return [] if c.packed is not None else list(c.rows)
    return [c]


def token_split(caches: list) -> tuple[int, int]:
    """(compressed, dense) stored tokens, summed over attention layers and rows: what the codec
    holds, and what stays full precision (sinks, recent tokens, a block not yet full, layers or
    rows not converted yet, mlx-lm's own caches)."""
    enc = dense = 0
    for c in caches:
        if isinstance(c, BatchCompressedKVCache) and c.packed is not None:
            n = sum(c.packed.lengths)
            if c.packed.template.key_codec is not None:
                enc += n
            else:
                dense += n
            continue
        for r in _rows(c):
            if isinstance(r, CompressedKVCache):
                e = r.enc.n * r.block_tokens
                enc, dense = enc + e, dense + r.size() - e
            elif _elements(r):
                dense += int(r.size())
    return enc, dense


def kv_summary(caches: list) -> dict:
    """Attention-KV bytes, logical elements and bits per element (other state excluded), and
    the stored tokens split into compressed and dense (summed over layers and rows)."""
    attn = [c for c in caches if _elements(c)]
    nbytes = kv_bytes(attn)
    elements = sum(_elements(c) for c in attn)
    enc, dense = token_split(attn)
    return {
        "kv_bytes": nbytes,
        "kv_elements": elements,
        "bits_per_element": round(8 * nbytes / elements, 3) if elements else None,
        "compressed_tokens": enc,
        "dense_tokens": dense,
        "other_state_bytes": kv_bytes([c for c in caches if c not in attn]),
    }
