"""KV persistence: save a run's caches with their token prefix, open them back (checked), convert
them to another KV policy, and inspect them; under several ranks, one file per rank. Never prints;
errors are `MlxkvError`s."""

from .convert import ConvertResult, convert_cache_file
from .file import CacheFile, open_cache_file, save_cache
from .fingerprint import check_fingerprint, model_fingerprint
from .inspect import inspect_cache
from .safetensors import CacheFileError
from .sharding import Sharding, check_sharding, local_kv_heads, rank_path

__all__ = ["CacheFile", "CacheFileError", "ConvertResult", "check_fingerprint", "convert_cache_file",
           "Sharding", "check_sharding", "inspect_cache", "local_kv_heads", "model_fingerprint", "open_cache_file",
           "rank_path", "save_cache"]
