from .. import attention  # noqa: F401  (first: its modules import this package's, which import kvcore.attention)
from .batch import BatchCompressedKVCache
from .compressed import CompressedKVCache
from .view import BatchKVView, KVView, Segment

__all__ = ["BatchCompressedKVCache", "BatchKVView", "CompressedKVCache", "KVView", "Segment"]
