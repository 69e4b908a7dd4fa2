from .compressed import CompressedKVCache
from .view import KVView, Segment

__all__ = ["CompressedKVCache", "KVView", "Segment"]
