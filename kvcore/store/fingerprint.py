"""Which model a cache belongs to: architecture, shape, hashes of config and vocabulary, and a sample
of its weights.

The config hash covers config.json with volatile keys removed (at any depth): paths, tool
versions and the weight dtype (`torch_dtype`/`dtype`: converting weights to another dtype
keeps a cache usable; the KV dtype is recorded per layer). Quantization settings stay in:
quantized weights produce different K/V. The tokenizer hash covers the sorted vocabulary
(`get_vocab()`), so it also works for tokenizers rebuilt from GGUF metadata.

Two checkpoints of one architecture (a base model and its instruct fine-tune) share config and
vocabulary, so the fingerprint also keeps `SAMPLE` values of the weights of the first, middle and
last layers and of everything outside the layers, at fixed positions. They are compared with a
tolerance (`WEIGHT_RTOL`, above a dtype conversion's rounding: bfloat16 keeps 8 bits, 0.4%), so a
converted copy still matches, while a fine-tune moves most sampled values by more. Quantized words
compare exactly. LoRA adapters' own weights are left out (served adapters have fingerprints of
their own), and so are tensor-parallel shards (each rank holds another slice; the replicated
tensors, norms and embeddings, are compared); a cache from before the sample (no "weights" entry)
is not checked on it.
"""

from __future__ import annotations

import hashlib
import json
import re

import mlx.core as mx

from ..errors import MlxkvError

SAMPLE = 4  # values per sampled weight tensor
WEIGHT_RTOL = 0.01
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")

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


def weight_sample(model) -> dict[str, list]:
    """name -> SAMPLE values (float, or int for quantized words) of the model's weights outside its
    layers and in its first, middle and last layers (LoRA weights aside)."""
    from mlx.utils import tree_flatten

    sharded = {name for name, m in model.named_modules() if type(m).__module__.startswith("mlx.nn.layers.distributed")}
    params = [(n, a) for n, a in tree_flatten(model.parameters())
              if isinstance(a, mx.array) and "lora" not in n and n.rsplit(".", 1)[0] not in sharded]
    layers = sorted({int(m.group(1)) for n, _ in params if (m := _LAYER.search(n))})
    keep = {layers[0], layers[len(layers) // 2], layers[-1]} if layers else set()
    picked = [(n, a) for n, a in params if a.size and ((m := _LAYER.search(n)) is None or int(m.group(1)) in keep)]
    out = {}
    for name, a in picked:
        idx = mx.array([(a.size * (2 * i + 1)) // (2 * SAMPLE) for i in range(SAMPLE)])
        vals = a.reshape(-1)[idx]
        ints = mx.issubdtype(a.dtype, mx.integer)
        out[name] = [int(v) for v in vals.tolist()] if ints else [float(v) for v in vals.astype(mx.float32).tolist()]
    return out


def _weights_differ(saved: dict, current: dict) -> str | None:
    """The first sampled weight that differs beyond the tolerance, else None."""
    for name, want in saved.items():
        got = current.get(name)
        if got is None:
            continue  # a tensor this run holds a shard of (or not at all: the config hash has spoken)
        if not isinstance(want, list) or len(got) != len(want):
            return name
        for a, b in zip(want, got):
            if not isinstance(a, (int, float)) or isinstance(a, bool):
                return name  # a damaged document: not a weight of this model
            if isinstance(a, int) and isinstance(b, int):
                if a != b:
                    return name
            elif abs(a - b) > WEIGHT_RTOL * max(abs(a), abs(b)) + 1e-12:
                return name
    return None


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
        "weights": weight_sample(model),
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
    if isinstance(saved.get("weights"), dict):
        name = _weights_differ(saved["weights"], current.get("weights") or {})
        if name is not None:
            raise MlxkvError(f"the cache was made with other weights of this architecture ({name} differs): "
                             "another checkpoint or a fine-tune")
