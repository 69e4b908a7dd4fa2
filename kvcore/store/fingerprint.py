"""Which model a cache belongs to: architecture, shape, and hashes of config and vocabulary.

The config hash covers config.json with volatile keys removed (at any depth): paths, tool
versions and the weight dtype (`torch_dtype`/`dtype`: converting weights to another dtype
keeps a cache usable; the KV dtype is recorded per layer). Quantization settings stay in:
quantized weights produce different K/V. The tokenizer hash covers the sorted vocabulary
(`get_vocab()`), so it also works for tokenizers rebuilt from GGUF metadata.
"""

from __future__ import annotations

import hashlib
import json

from ..errors import MlxkvError

VOLATILE_KEYS = frozenset({"_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash",
                           "use_cache"})


def _normalize(x):
    if isinstance(x, dict):
        return {k: _normalize(v) for k, v in x.items() if k not in VOLATILE_KEYS}
    if isinstance(x, list):
        return [_normalize(v) for v in x]
    return x


def _sha256_json(x) -> str:
    return hashlib.sha256(json.dumps(x, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def config_sha256(config: dict) -> str:
    return _sha256_json(_normalize(config))


def tokenizer_sha256(tokenizer) -> str:
    return _sha256_json(sorted(tokenizer.get_vocab().items()))


def model_fingerprint(model, tokenizer, config: dict) -> dict:
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    heads = text.get("num_attention_heads")
    head_dim = text.get("head_dim") or (text["hidden_size"] // heads if heads and "hidden_size" in text else None)
    layers = getattr(model, "layers", None)
    caches = model.make_cache() if hasattr(model, "make_cache") else layers
    return {
        "model_type": config.get("model_type"),
        "architecture": (config.get("architectures") or [None])[0],
        "layers": len(layers) if layers is not None else text.get("num_hidden_layers"),
        "caches": len(caches) if caches is not None else None,
        "kv_heads": text.get("num_key_value_heads", heads),
        "head_dim": head_dim,
        "config_sha256": config_sha256(config),
        "tokenizer_sha256": tokenizer_sha256(tokenizer),
    }


def _describe(fp: dict) -> str:
    return f"{fp.get('model_type')} with {fp.get('layers')} layers"


def check_fingerprint(saved: dict, current: dict) -> None:
    """Raise naming the first difference between the cache's model and this one."""
    if any(saved.get(k) != current.get(k) for k in ("model_type", "layers", "caches")):
        raise MlxkvError(f"the cache is for {_describe(saved)}; this model is {_describe(current)}")
    for key, label in (("kv_heads", "KV heads"), ("head_dim", "head_dim")):
        if saved.get(key) != current.get(key):
            raise MlxkvError(f"the cache is for a model with {saved.get(key)} {label}; this model has "
                             f"{current.get(key)} ({_describe(current)})")
    if saved.get("config_sha256") != current.get("config_sha256"):
        raise MlxkvError(f"the cache was made with a different model config ({_describe(current)}: config hash "
                         f"{str(saved.get('config_sha256'))[:12]} in the cache, {current['config_sha256'][:12]} here)")
    if saved.get("tokenizer_sha256") != current.get("tokenizer_sha256"):
        raise MlxkvError("the cache was made with a different tokenizer (vocabulary hash differs)")
