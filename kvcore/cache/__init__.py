from .batch import BatchCompressedKVCache
from .compressed import CompressedKVCache
from .view import BatchKVView, KVView, Segment

__all__ = ["BatchCompressedKVCache", "BatchKVView", "CompressedKVCache", "KVView", "Segment"]
