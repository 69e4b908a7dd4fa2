"""Continue from mlx-lm's own prompt-cache files (`mlx_lm.cache_prompt`, `save_prompt_cache`).

Such a file (layout in mlx_lm_file.py) is converted on load into the layer entries an mlxkv
file would hold, and checked by the same rules (`check_document`), before any array is used:
```
KVCache / RotatingKVCache   -> mlx-lm's own caches (what mlxkv runs full precision with)
QuantizedKVCache            -> CompressedKVCache, affine bits/group, converted from token 0
                               (the same packed words; scales and biases stored as float16);
                               its KVCache layers then become full-precision CompressedKVCaches
ArraysCache / MambaCache    -> ArraysCache (SSM state)
```
Two limits, both said in a notice: the file holds no token ids, so text can only follow the
cached tokens raw (no prefix matching, no --prompt-file, no --save-cache of the result); and
the model check is weaker than for mlxkv files (cache count and kinds, windows, KV heads and
head_dim; no config or vocabulary hash).
"""

from __future__ import annotations

import re
from pathlib import Path

from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from .. import __version__
from ..errors import MlxkvError
from .file import FORMAT, VERSION, check_document
from .layers import KINDS, KV_DTYPES
from .mlx_lm_file import _layout, _scalar, looks_like_mlx_lm
from .safetensors import Container, open_container
from .sharding import Sharding

UNKNOWN = -1  # the token id standing for each cached token: the file holds none
_FULL = {"codec": "full", "bits": None, "group_size": None}


def is_mlx_lm_cache(path: str | Path) -> bool:
    """Whether `path` is an mlx-lm prompt cache (False for anything else, readable or not)."""
    try:
        c = open_container(path)
    except MlxkvError:
        return False
    return "mlxkv" not in c.metadata and looks_like_mlx_lm(c.metadata)


class MlxLmCache:
    """An mlx-lm prompt cache as `CacheFile` offers one: plan, restore, fresh, prefix_ids."""

    sharding = Sharding()

    def __init__(self, container: Container, entries: list[dict], sources: list[list], n: int):
        self.container, self.entries, self.sources, self.n = container, entries, sources, n
        self.prefix_ids = [UNKNOWN] * n
        quantized = sorted({f"affine:{e['key']['bits']}/g{e['key']['group_size']}" for e in entries
                            if e["kind"] == "compressed" and e["key"]["codec"] == "affine"})
        self.notice = (f"continuing from an mlx-lm prompt cache ({n} tokens"
                       + (f", {', '.join(quantized)} read as mlxkv's affine cache with float16 scales" if quantized
                          else "") + "): it holds no token ids, so -p text follows the cached tokens raw (no "
                       "prefix is matched), and the model check is weaker than for mlxkv files (cache count and "
                       "kinds, windows, KV heads, head_dim; no config or vocabulary hash)")

    @property
    def path(self) -> Path:
        return self.container.path

    def set_key(self) -> str:
        return f"mlx-lm:{self.n}:{[e['kind'] for e in self.entries]}"

    def plan(self) -> list:
        return [KINDS[e["kind"]].plan(e, i) for i, e in enumerate(self.entries)]

    def fresh(self) -> list:
        return [KINDS[e["kind"]].fresh(e) for e in self.entries]

    def restore(self) -> list:
        arrays = self.container.load_arrays()
        return [KINDS[e["kind"]].rebuild(e, [convert(arrays[name]) for name, convert in src])
                for e, src in zip(self.entries, self.sources)]


def _arrays_of(c: Container, i: int) -> dict[str, object]:
    return {n[len(f"{i}."):]: t for n, t in c.tensors.items() if n.split(".", 1)[0] == str(i)}


def _none_paths(metadata: dict[str, str]) -> set[str]:
    """Tree paths mlx-lm saved as None (an empty array marked "none" in its scalar table)."""
    paths = {}
    for k, v in metadata.items():
        m = re.fullmatch(r"2\.(\d+)\.([01])", k)
        if m:
            paths.setdefault(m[1], {})[m[2]] = v
    return {p["0"] for p in paths.values() if p.get("1") == "none" and "0" in p}


def _take(n: int):
    return lambda a: a[:, :, :n]


def _as_meta(n: int):
    from ..codecs.affine import META_DTYPE

    return lambda a: a[:, :, :n].astype(META_DTYPE)


def _entry(c: Container, i: int, name: str, none: set[str], fail) -> tuple[dict, list]:
    """(mlxkv layer entry, [(array name, converter)]) for cache i of class `name`."""
    own = _arrays_of(c, i)
    scalar = lambda j: _scalar(c, own.get(str(j)))  # noqa: E731
    if name in ("ArraysCache", "MambaCache"):
        keys = sorted((k for k in own if k.isdigit()), key=int)
        present = [f"{i}.{k}" not in none for k in keys]
        return {"kind": "arrays", "present": present}, [(f"{i}.{k}", lambda a: a) for k, p in zip(keys, present) if p]
    if name not in ("KVCache", "RotatingKVCache", "QuantizedKVCache"):
        raise fail(f"cache {i} is a {name[:64]}: mlxkv cannot continue from that class")
    quant = name == "QuantizedKVCache"
    k, v = (own.get("0.0"), own.get("1.0")) if quant else (own.get("0"), own.get("1"))
    n = scalar(2)
    if k is None or v is None or len(k.shape) != 4 or len(v.shape) != 4 or not n:
        raise fail(f"cache {i} ({name}) holds no tokens")
    B, H, cap = k.shape[:3]
    if quant:
        group, bits, scales = scalar(3), scalar(4), own.get("0.1")
        if not bits or not group or scales is None:
            raise fail(f"cache {i} (QuantizedKVCache) has no bits, group size or scales")
        D, Dv = k.shape[3] * 32 // bits, v.shape[3] * 32 // bits
        spec = {"codec": "affine", "bits": bits, "group_size": group}
        entry = {"kind": "compressed", "key": spec, "value": spec, "start": 0, "window": None, "keep": 0,
                 "offset": n, "converted": True, "enc_start": 0, "tail_start": n, "sink": 0, "enc": n, "tail": 0,
                 "recent": 0, "key_parts": 3, "dims": [B, H, D, Dv], "dtype": scales.dtype}
        parts = [f"{i}.{a}.{b}" for a in (0, 1) for b in (0, 1, 2)]
        return entry, [(p, _take(n) if p.endswith(".0") else _as_meta(n)) for p in parts]
    dims = {"dims": [B, H, k.shape[3], v.shape[3]], "dtype": k.dtype}
    if name == "KVCache":
        if n > cap:
            raise fail(f"cache {i} (KVCache) says {n} tokens but stores {cap}")
        return {"kind": "kv", "offset": n, **dims}, [(f"{i}.0", _take(n)), (f"{i}.1", _take(n))]
    keep, size, idx = scalar(3), scalar(4), scalar(5)
    if keep is None or not size or idx is None:
        raise fail(f"cache {i} (RotatingKVCache) lacks its keep, size or position")
    stored = min(cap, n)
    entry = {"kind": "rotating", "offset": n, "max_size": size, "keep": keep, "idx": idx, "stored": stored, **dims}
    return entry, [(f"{i}.0", _take(stored)), (f"{i}.1", _take(stored))]


def _as_full_compressed(e: dict) -> dict:
    """A KVCache layer beside quantized ones: a full-precision CompressedKVCache (as build_caches
    makes every attention layer when anything is compressed)."""
    return {"kind": "compressed", "key": _FULL, "value": _FULL, "start": None, "window": None, "keep": 0,
            "offset": e["offset"], "converted": False, "enc_start": 0, "tail_start": 0, "sink": 0, "enc": 0,
            "tail": e["offset"], "recent": 0, "key_parts": None, "dims": e["dims"], "dtype": e["dtype"]}


def _shapes(c: Container, entries: list[dict], sources: list[list]) -> dict:
    """What the converted arrays will be (shape, dtype), by mlxkv's names, without loading any."""
    out = {}
    for i, (e, src) in enumerate(zip(entries, sources)):
        for j, (name, _) in enumerate(src):
            t = c.tensors[name]
            shape, dtype = t.shape, t.dtype
            if e["kind"] in ("kv", "rotating", "compressed"):
                n = e["stored"] if e["kind"] == "rotating" else e["offset"]
                shape = (*shape[:2], min(n, shape[2]), *shape[3:])
                if e["kind"] == "compressed" and e["key"]["codec"] == "affine" and not name.endswith(".0"):
                    dtype = "float16"
            out[f"layers.{i}.{j}"] = (tuple(shape), dtype)
    return out


def open_mlx_lm_cache(path: str | Path, lm, sharding: Sharding = Sharding()) -> MlxLmCache:
    """Open, convert and check an mlx-lm prompt cache for the model `lm` (one-line errors)."""
    c = open_container(path)
    fail = c.fail
    if not sharding.single:
        raise fail(f"an mlx-lm prompt cache holds one process's KV heads; this run has {sharding.ranks} ranks")
    classes, meta = _layout(c.metadata)
    if meta is not None:
        raise fail("an mlx-lm prompt cache in mlx-lm's old layout (meta_state strings): inspect-cache reads it; "
                   "save it again with a current mlx-lm to continue from it")
    if not classes or sorted(classes) != list(range(len(classes))):
        raise fail("an mlx-lm prompt cache without a class for every cache")
    none = _none_paths(c.metadata)
    pairs = [_entry(c, i, classes[i], none, fail) for i in range(len(classes))]
    entries, sources = [e for e, _ in pairs], [s for _, s in pairs]
    if any(e["kind"] == "compressed" for e in entries):
        if any(e["kind"] == "rotating" for e in entries):
            raise fail("an mlx-lm prompt cache with quantized and sliding-window layers: not supported")
        entries = [_as_full_compressed(e) if e["kind"] == "kv" else e for e in entries]
    counts = {e["offset"] for e in entries if "offset" in e}
    if len(counts) != 1:
        raise fail(f"the caches hold different token counts ({sorted(counts)}); mlxkv continues one sequence")
    n = counts.pop()
    _check_model(entries, lm, fail)
    doc = {"format": FORMAT, "version": VERSION, "mlxkv_version": __version__, "created": "", "model": {},
           "prefix_tokens": n, "layers": entries}
    have = {**_shapes(c, entries, sources), "prefix_ids": ((n,), "int32")}
    doc["arrays"] = {name: {"dtype": d, "shape": list(s), "sha256": ""} for name, (s, d) in have.items()}
    for e in entries:
        if e.get("dtype") is not None and e["dtype"] not in KV_DTYPES:
            raise fail(f"KV stored as {e['dtype']}: not a float dtype mlxkv runs in")
    check_document(doc, have, fail)
    return MlxLmCache(c, entries, sources, n)


def _check_model(entries: list[dict], lm, fail) -> None:
    """The weaker model check: cache count and kinds, windows, KV heads and head_dim."""
    model = lm.model
    template = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers]
    if len(template) != len(entries):
        raise fail(f"the file holds {len(entries)} caches; this model has {len(template)}")
    text = lm.config.get("text_config", lm.config)
    heads = text.get("num_key_value_heads") or text.get("num_attention_heads")
    head_dim = text.get("head_dim") or (text["hidden_size"] // text["num_attention_heads"]
                                        if text.get("hidden_size") and text.get("num_attention_heads") else None)
    uniform = not any(k in text for k in ("global_head_dim", "num_global_key_value_heads"))
    for i, (e, t) in enumerate(zip(entries, template)):
        want = "arrays" if isinstance(t, ArraysCache) else "rotating" if type(t) is RotatingKVCache else "kv"
        got = "arrays" if e["kind"] == "arrays" else "rotating" if e["kind"] == "rotating" else "kv"
        if want != got:
            raise fail(f"cache {i} is a {got} cache; this model's layer {i} needs a {want} cache")
        if got == "rotating" and (e["max_size"], e["keep"]) != (t.max_size, t.keep):
            raise fail(f"cache {i} is a window of {e['max_size']} (keep {e['keep']}); this model's is "
                       f"{t.max_size} (keep {t.keep})")
        if got != "arrays" and uniform and heads and head_dim:
            B, H, D, _ = e["dims"]
            if B != 1:
                raise fail(f"cache {i} holds {B} rows; --load-cache continues one")
            if (H, D) != (heads, head_dim):
                raise fail(f"cache {i} has {H} KV heads of {D}; this model has {heads} of {head_dim}")
