"""KV persistence: save a run's caches with their token prefix, open them back (checked), convert
them to another KV policy, and inspect them; under several ranks, one file per rank. Never prints;
errors are `MlxkvError`s."""

__all__ = ["CacheFile", "CacheFileError", "ConvertResult", "check_fingerprint", "convert_cache_file",
           "Sharding", "check_sharding", "inspect_cache", "local_kv_heads", "model_fingerprint", "open_cache_file",
           "rank_path", "save_cache"]

from ..lazy import exports  # noqa: E402

__getattr__ = exports(__name__, {
    "ConvertResult": "convert", "convert_cache_file": "convert",
    "CacheFile": "file", "open_cache_file": "file", "save_cache": "file",
    "check_fingerprint": "fingerprint", "model_fingerprint": "fingerprint",
    "inspect_cache": "inspect",
    "CacheFileError": "safetensors",
    "Sharding": "sharding", "check_sharding": "sharding", "local_kv_heads": "sharding", "rank_path": "sharding",
})
