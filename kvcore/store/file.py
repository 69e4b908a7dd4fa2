"""The mlxkv cache file: save a model's caches with their token prefix, open one back, checked.

Format "mlxkv-kv", version 3: a safetensors file whose metadata key "mlxkv" holds one JSON
document and "mlxkv_sha256" the sha256 of that document's text:
```
{"format": "mlxkv-kv", "version": 3, "mlxkv_version": "0.1.0", "created": "2025-...Z",
 "model": {model_type, architecture, layers, caches, kv_heads, head_dim, config_sha256, tokenizer_sha256,
           weights: {name: a few sampled values}},
 "sharding": {"ranks": R, "rank": r, "kv_heads": H},   (one rank's file of several only: see sharding.py)
 "prefix_tokens": N,
 "layers": [{"kind": "compressed" | "kv" | "rotating" | "arrays", ...fields of that kind}, ...],
 "arrays": {name: {"dtype", "shape", "sha256"}, ...}}
```
Arrays: `prefix_ids` (int32, (N,): the tokens the caches hold) and `layers.{i}.{j}`.
The document's checksum covers every per-layer setting (a flipped bit in `"window": 32` is refused),
and through the array table every array's bytes. Versions 1 (a single process) and 2 (one rank's
file) are still read: their arrays are checksummed, their document is not; a file that carries a
document checksum has it checked whatever its version.
Opening checks the container, the document, every array's dtype/shape against the layer
entries, and every checksum, before any array is loaded. Saving runs the same document and
shape checks on what it is about to write, so mlxkv never writes a file it would refuse to read.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import mlx.core as mx

from .. import __version__
from ..errors import MlxkvError
from .atomic import atomic_write
from .layers import KINDS, STATE_DTYPES, kind_of_cache
from .mlx_lm_file import looks_like_mlx_lm
from .safetensors import Container, array_sha256, dtype_name, is_int, open_container
from .schema import Fields
from .sharding import Sharding, read_sharding, set_key

FORMAT, VERSION, META_KEY, SUM_KEY, PREFIX = "mlxkv-kv", 3, "mlxkv", "mlxkv_sha256", "prefix_ids"
OLD_VERSIONS = (1, 2)  # read without a document checksum: 1 a single process, 2 one rank's file (sharding)
MAX_LAYERS = 4096

Shapes = dict[str, tuple[tuple[int, ...], str]]  # array name -> (shape, dtype name)


@dataclass
class CacheFile:
    container: Container
    header: dict
    prefix_ids: list[int]

    @property
    def path(self) -> Path:
        return self.container.path

    @property
    def layers(self) -> list[dict]:
        return self.header["layers"]

    @property
    def fingerprint(self) -> dict:
        return self.header["model"]

    @property
    def sharding(self) -> Sharding:
        s = self.header.get("sharding")
        return Sharding(s["ranks"], s["rank"], s["kv_heads"]) if s else Sharding()

    def set_key(self) -> str:
        """Equal for the rank files of one saved set (same model, tokens and KV settings)."""
        return set_key(self.header, self.prefix_ids)

    def layer_tensors(self, i: int) -> list:
        n = sum(1 for name in self.container.tensors if name.startswith(f"layers.{i}."))
        return [self.container.tensors[f"layers.{i}.{j}"] for j in range(n)]

    def kv_bytes(self) -> int:
        return sum(t.nbytes for name, t in self.container.tensors.items() if name != PREFIX)

    def arrays(self) -> dict[str, mx.array]:
        return self.container.load_arrays()

    def restore_layer(self, i: int, arrays: dict[str, mx.array]):
        entry = self.layers[i]
        return KINDS[entry["kind"]].rebuild(entry, [arrays[t.name] for t in self.layer_tensors(i)])

    def restore(self) -> list:
        """The caches as saved, ready to continue from `len(prefix_ids)`."""
        arrays = self.arrays()
        return [self.restore_layer(i, arrays) for i in range(len(self.layers))]

    def fresh(self) -> list:
        """Empty caches with the same kinds and KV settings (to prefill from scratch)."""
        return [KINDS[e["kind"]].fresh(e) for e in self.layers]

    def plan(self) -> list:
        return [KINDS[e["kind"]].plan(e, i) for i, e in enumerate(self.layers)]


def _offset(cache) -> int | None:
    return getattr(cache, "offset", None)


def save_cache(path: str | Path, caches: list, prefix_ids: list[int], fingerprint: dict,
               sharding: Sharding = Sharding()) -> int:
    """Write `caches` (holding exactly `prefix_ids`; one rank's heads if `sharding` says so) atomically;
    returns the file size."""
    n = len(prefix_ids)
    if n < 1:
        raise MlxkvError("nothing to save: the caches hold no tokens")
    entries, arrays = [], {}
    for i, c in enumerate(caches):
        if _offset(c) is not None and _offset(c) != n:
            raise MlxkvError(f"layer {i} holds {_offset(c)} tokens, the prefix has {n}")
        entry, parts = kind_of_cache(c).write(c)
        entries.append(entry)
        arrays.update({f"layers.{i}.{j}": a for j, a in enumerate(parts)})
    arrays[PREFIX] = mx.array(prefix_ids, dtype=mx.int32)
    table = {name: {"dtype": dtype_name(a.dtype), "shape": list(a.shape), "sha256": array_sha256(a)}
             for name, a in arrays.items()}
    doc = {
        "format": FORMAT, "version": VERSION, "mlxkv_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "model": fingerprint,
        **({} if sharding.single else {"sharding": sharding.to_json()}),
        "prefix_tokens": n, "layers": entries, "arrays": table,
    }

    def refuse(msg: str) -> MlxkvError:  # a cache this mlxkv would refuse to load is never written
        return MlxkvError(f"not saving {path}: {msg} (--load-cache would refuse the file)")

    check_document(doc, {name: (tuple(a.shape), dtype_name(a.dtype)) for name, a in arrays.items()}, refuse)
    if min(prefix_ids) < 0:
        raise refuse("the prefix holds negative token ids")
    raw = json.dumps(doc)
    metadata = {META_KEY: raw, SUM_KEY: _text_sha256(raw)}
    atomic_write(path, lambda f: mx.save_safetensors(f, arrays, metadata=metadata))
    return Path(path).stat().st_size


def _text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def open_cache_file(path: str | Path) -> CacheFile:
    """Open and fully check an mlxkv cache file (arrays are not loaded yet)."""
    c = open_container(path)
    fail = c.fail
    raw = c.metadata.get(META_KEY)
    if raw is None:
        if looks_like_mlx_lm(c.metadata):
            raise fail("an mlx-lm prompt cache, not an mlxkv cache (inspect-cache reads it, generate --load-cache "
                       "continues from it; convert-kv takes mlxkv caches)")
        raise fail(f"not an mlxkv cache (no {META_KEY!r} metadata)")
    digest = c.metadata.get(SUM_KEY)
    if digest is not None and digest != _text_sha256(raw):
        raise fail("checksum mismatch for the mlxkv document (its per-layer settings): the header is damaged")
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, RecursionError):
        raise fail("the mlxkv header is not valid JSON")
    if isinstance(doc, dict) and doc.get("version") == VERSION and digest is None:
        raise fail(f"a version {VERSION} file must carry {SUM_KEY!r} (the document's checksum): the header is "
                   f"damaged")
    check_document(doc, {name: (t.shape, t.dtype) for name, t in c.tensors.items()}, fail)
    table = doc["arrays"]
    for name in sorted(table):
        if c.sha256(c.tensors[name]) != table[name].get("sha256"):
            raise fail(f"checksum mismatch for array {name!r}: the data is damaged")
    n = doc["prefix_tokens"]
    ids = struct.unpack(f"<{n}i", c.read(c.tensors[PREFIX]))
    if min(ids) < 0:
        raise fail("prefix_ids holds negative token ids")
    return CacheFile(c, doc, list(ids))


def check_document(doc, have: Shapes, fail) -> None:
    """The rules every cache document obeys, on reading and on saving: its fields, each layer's
    settings, and that the arrays `have` (name -> shape, dtype) are exactly what the layers need."""
    f = Fields(doc, "header", fail)
    if f.get("format") != FORMAT:
        raise fail(f"unknown format {doc['format']!r} (expected {FORMAT!r})")
    version = f.get("version")
    if not is_int(version) or version not in (VERSION, *OLD_VERSIONS):
        raise fail(f"unsupported format version {version!r} (this mlxkv reads versions "
                   f"{', '.join(map(str, (*OLD_VERSIONS, VERSION)))})")
    f.str("mlxkv_version"), f.str("created"), f.sub("model")
    if version == 2 or (version == VERSION and "sharding" in doc):
        read_sharding(f)
    elif "sharding" in doc:
        raise fail(f"a version {version} file cannot record 'sharding'")
    n = f.int("prefix_tokens", lo=1)
    expected = {PREFIX: ((n,), "int32")}
    layers = f.get("layers")
    if not isinstance(layers, list) or not 1 <= len(layers) <= MAX_LAYERS:
        raise fail("header: 'layers' must be a non-empty list")
    for i, entry in enumerate(layers):
        lf = Fields(entry, f"layer {i}", fail)
        kind = lf.str("kind", tuple(KINDS))
        expected.update({f"layers.{i}.{j}": s for j, s in enumerate(KINDS[kind].check(lf, fail))})
        if kind != "arrays" and entry["offset"] != n:
            raise fail(f"layer {i} holds {entry['offset']} tokens, the prefix has {n}")
    _check_arrays(have, f.sub("arrays"), expected, fail)


def _check_arrays(have: Shapes, table: Fields, expected: dict, fail) -> None:
    for name in sorted(set(expected) | set(table.obj)):
        if name not in expected:
            raise fail(f"unexpected array {name!r} in the header")
        if name not in have or name not in table.obj:
            raise fail(f"missing array {name!r}")
    for name in have:
        if name not in expected:
            raise fail(f"unexpected array {name!r} in the file")
    for name, want in expected.items():
        (shape, dtype), info = have[name], Fields(table.obj[name], f"array {name!r}", fail)
        listed, listed_dtype = info.get("shape"), info.str("dtype")
        info.str("sha256")
        if list(shape) != listed or dtype != listed_dtype:
            raise fail(f"array {name!r} is {dtype}{list(shape)} in the file, {listed_dtype}{listed} in the header")
        if want is not None and (tuple(want[0]) != tuple(shape) or want[1] != dtype):
            raise fail(f"array {name!r} is {dtype}{list(shape)}; its layer needs {want[1]}{list(want[0])}")
        if want is None and (dtype not in STATE_DTYPES or not shape):
            raise fail(f"array {name!r}: {dtype}{list(shape)} is not a state array")
