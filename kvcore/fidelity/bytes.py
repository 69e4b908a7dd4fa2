"""KV bytes as a float16 deployment stores them, whatever dtype the run used.

Codec payloads (packed indices, words) count as stored; every scale, bias, norm and every
full-precision element counts 2 bytes. For mlxkv caches the codecs already store their
metadata as float16, so only the dense parts (sink, recent/tail tokens) change size with the
run's dtype; mlx-lm's QuantizedKVCache keeps scales in the run's dtype and preallocates in
steps of 256 tokens (the spare capacity is not counted).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_lm.models.cache import KVCache, QuantizedKVCache

from ..cache import CompressedKVCache

F16 = 2


@dataclass
class KVBytes:
    deployed: int  # bytes at float16 for dense data and metadata
    nbytes: int  # bytes of the arrays this run holds
    elements: int  # logical K+V elements (tokens x heads x dims)

    @property
    def bits_per_element(self) -> float | None:
        return 8 * self.deployed / self.elements if self.elements else None

    def __add__(self, other: "KVBytes") -> "KVBytes":
        return KVBytes(self.deployed + other.deployed, self.nbytes + other.nbytes, self.elements + other.elements)


def _compressed(c: CompressedKVCache) -> KVBytes:
    tokens = c.size()
    if tokens == 0:
        return KVBytes(0, 0, 0)
    dense = (c.sink.n + c.tail.n) * (c.elements // tokens)  # elements per token: B x H x (D + Dv)
    return KVBytes(c.enc.nbytes + dense * F16, c.nbytes, c.elements)


def _quantized(c: QuantizedKVCache) -> KVBytes:
    if c.keys is None:
        return KVBytes(0, 0, 0)
    n, deployed, nbytes = c.offset, 0, 0
    for w, s, b in (c.keys, c.values):
        used = lambda a: a.nbytes * n // a.shape[2]  # noqa: E731
        deployed += used(w) + (s.size + b.size) * n // s.shape[2] * F16
        nbytes += used(w) + used(s) + used(b)
    B, H = c.keys[0].shape[:2]
    D = c.keys[0].shape[-1] * 32 // c.bits
    Dv = c.values[0].shape[-1] * 32 // c.bits
    return KVBytes(deployed, nbytes, n * B * H * (D + Dv))


def _dense(c: KVCache) -> KVBytes:
    if c.keys is None:
        return KVBytes(0, 0, 0)
    B, H, _, D = c.keys.shape
    elements = c.offset * B * H * (D + c.values.shape[-1])
    return KVBytes(elements * F16, elements * c.keys.dtype.size, elements)


_KINDS = {CompressedKVCache: _compressed, QuantizedKVCache: _quantized, KVCache: _dense}


def kv_bytes(caches: list) -> KVBytes:
    """Summed over the attention layers of a cache list (other kinds of state are skipped)."""
    total = KVBytes(0, 0, 0)
    for c in caches:
        count = _KINDS.get(type(c))
        if count is not None:
            total = total + count(c)
    return total
