"""How each kind of layer cache is written to and rebuilt from a cache file.

A registry maps kind names to a `LayerKind` (write, check, rebuild, describe); a cache
picks its kind by exact type when saved, a file picks code by the kind name it records
(validated against this registry), never by a class name.

Arrays of layer i are stored as `layers.{i}.{j}`, in the order `arrays(entry)` lists them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from ..cache import CompressedKVCache
from ..codecs import BITS, FULL, GROUPS, CodecSpec, codec_names, make_codec
from ..errors import MlxkvError
from ..policy import LayerPlan
from ..policy.kv_spec import GROUPED
from .safetensors import dtype_name
from .schema import Fail, Fields

KV_DTYPES = ("float32", "float16", "bfloat16")
STATE_DTYPES = ("float32", "float16", "bfloat16", "int32", "uint32", "int64", "uint8", "bool")
MAX_DIM = 2**16  # bound on batch, heads and head dims read from a file

Shape = tuple[tuple[int, ...], str]  # (shape, dtype name) an array must have


@dataclass(frozen=True)
class LayerKind:
    name: str
    cls: type
    write: Callable  # cache -> (entry, arrays)
    check: Callable  # (Fields, fail) -> expected [(shape, dtype) | None]  (None: any shape)
    rebuild: Callable  # (entry, arrays) -> cache
    fresh: Callable  # entry -> an empty cache of the same kind and settings
    plan: Callable  # (entry, index) -> LayerPlan
    tokens: Callable  # entry -> stored tokens (None where not a token sequence)


def _dims(f: Fields) -> tuple[int, int, int, int] | None:
    dims = f.ints("dims", 4, lo=1, hi=MAX_DIM, optional=True)
    if dims is not None:
        f.str("dtype", KV_DTYPES)
    return None if dims is None else tuple(dims)


def _kv_shapes(entry: dict, n: int) -> list[Shape]:
    B, H, D, Dv = entry["dims"]
    return [((B, H, n, D), entry["dtype"]), ((B, H, n, Dv), entry["dtype"])] if n else []


def _elements(entry: dict, n: int) -> int:
    B, H, D, Dv = entry["dims"] or (0, 0, 0, 0)
    return n * B * H * (D + Dv)


# -- CompressedKVCache ------------------------------------------------------------------------
def _write_compressed(c: CompressedKVCache):
    return {"kind": "compressed", **c.layout()}, list(c.state)


def _spec(f: Fields, key: str) -> CodecSpec:
    s = f.sub(key)
    name = s.str("codec", codec_names())
    if name == "full":
        return FULL
    bits, group = s.int("bits", 1, 64), s.int("group_size", 1, 4096, optional=name not in GROUPED)
    if name == "affine" and (bits not in BITS or group not in GROUPS):
        raise f.fail(f"{f.where}.{key}: affine bits/group {bits}/{group} not in {list(BITS)}/{list(GROUPS)}")
    return CodecSpec(name, bits, group)


def _codec(spec: CodecSpec, dim: int, fail: Fail):
    try:
        return make_codec(spec, dim)
    except ValueError as e:
        raise fail(str(e))


def _check_compressed(f: Fields, fail: Fail) -> list[Shape]:
    e, w = f.obj, f.where
    kspec, vspec = _spec(f, "key"), _spec(f, "value")
    start = f.int("start", optional=True)
    if start is None and (kspec.compresses or vspec.compresses):
        raise fail(f"{w}: a compressing codec needs a start")
    window, keep = f.int("window", lo=1, optional=True), f.int("keep")
    recent = f.int("recent") if "recent" in e else 0  # files before `recent` have none
    if recent and start is None:
        raise fail(f"{w}: recent tokens {recent} without a compressing codec")
    if (window is not None and keep >= window) or (window is None and keep):
        raise fail(f"{w}: keep {keep} does not fit window {window}")
    offset, converted = f.int("offset"), f.bool("converted")
    enc_start, tail_start = f.int("enc_start"), f.int("tail_start")
    n_sink, n_enc, n_tail = f.int("sink"), f.int("enc"), f.int("tail")
    key_parts = f.int("key_parts", lo=1, hi=16, optional=True)
    dims = _dims(f)
    if dims is None:
        if n_sink or n_enc or n_tail or offset:
            raise fail(f"{w}: stored tokens but no dims")
        return []
    B, H, D, Dv = dims
    kc, vc = _codec(kspec, D, fail), _codec(vspec, Dv, fail)
    bt = kc.block_tokens if kc else 1
    if vc and vc.block_tokens != bt:
        raise fail(f"{w}: key and value codecs use different block sizes")
    stored_from = enc_start if n_enc else tail_start
    if n_sink != (min(keep, offset) if window else 0):
        raise fail(f"{w}: {n_sink} sink tokens for keep {keep} and offset {offset}")
    if tail_start + n_tail != (max(offset, keep) if window else offset):
        raise fail(f"{w}: tail [{tail_start}, +{n_tail}) does not end at offset {offset}")
    if n_enc and (kc is None or vc is None or not converted or key_parts is None
                  or enc_start + n_enc * bt != tail_start):
        raise fail(f"{w}: encoded blocks inconsistent with the codecs, conversion or positions")
    if window is None and stored_from != 0:
        raise fail(f"{w}: a full-attention layer must store every token (starts at {stored_from})")
    if window is not None and not (keep <= stored_from <= max(keep, offset - window + keep + 1)
                                   and (stored_from - keep) % bt == 0):
        raise fail(f"{w}: stored tokens start at {stored_from}, outside what window {window} needs")
    shapes = _kv_shapes(e, n_sink)
    if n_enc:
        shapes += _encoded_shapes(kc, B, H, D, n_enc, e["dtype"], key_parts, w, fail)
        shapes += _encoded_shapes(vc, B, H, Dv, n_enc, e["dtype"], None, w, fail)
    return shapes + _kv_shapes(e, n_tail)


def _encoded_shapes(codec, B, H, D, n_blocks, dtype, n_parts, where, fail) -> list[Shape]:
    """Shapes of `n_blocks` encoded blocks, from encoding one block of zeros (B = H = 1)."""
    probe = codec.encode(mx.zeros((1, 1, codec.block_tokens, D), dtype=getattr(mx, dtype)))
    if n_parts is not None and n_parts != len(probe):
        raise fail(f"{where}: key_parts {n_parts}, the codec stores {len(probe)}")
    return [((B, H, n_blocks, *p.shape[3:]), dtype_name(p.dtype)) for p in probe]


def _rebuild_compressed(entry: dict, arrays: list):
    layout = {k: v for k, v in entry.items() if k != "kind"}
    return CompressedKVCache.from_state(tuple(arrays), (json.dumps(layout),))


def _fresh_compressed(e: dict):
    spec = lambda d: CodecSpec(d["codec"], d["bits"], d["group_size"])  # noqa: E731
    return CompressedKVCache(spec(e["key"]), spec(e["value"]), e["start"] or 0, e["window"], e["keep"],
                             recent=e.get("recent", 0))


def _plan_compressed(e: dict, i: int) -> LayerPlan:
    k, v = (CodecSpec(d["codec"], d["bits"], d["group_size"]) for d in (e["key"], e["value"]))
    return LayerPlan(i, "window" if e["window"] else "full-attention", k, e["start"], e["window"], e["keep"],
                     v if v != k else None, e.get("recent", 0))


def _tokens_compressed(e: dict) -> int:
    stored_from = e["enc_start"] if e["enc"] else e["tail_start"]
    return e["sink"] + max(0, e["offset"] - stored_from)


# -- mlx-lm's KVCache and RotatingKVCache -----------------------------------------------------
def _dims_of(keys, values) -> dict:
    if keys is None:
        return {"dims": None, "dtype": None}
    B, H, _, D = keys.shape
    return {"dims": [B, H, D, values.shape[-1]], "dtype": dtype_name(keys.dtype)}


def _write_kv(c: KVCache):
    entry = {"kind": "kv", "offset": c.offset, **_dims_of(c.keys, c.values)}
    if c.keys is None or not c.offset:
        return entry, []
    return entry, [c.keys[:, :, : c.offset], c.values[:, :, : c.offset]]


def _check_kv(f: Fields, fail: Fail) -> list[Shape]:
    offset, dims = f.int("offset"), _dims(f)
    if dims is None and offset:
        raise fail(f"{f.where}: stored tokens but no dims")
    return _kv_shapes(f.obj, offset) if dims else []


def _rebuild_kv(e: dict, arrays: list):
    c = KVCache()
    if arrays:
        c.keys, c.values = arrays
    c.offset = e["offset"]
    return c


def _write_rotating(c: RotatingKVCache):
    n = 0 if c.keys is None else min(c.keys.shape[2], c.offset)  # [offset, capacity) is unused
    entry = {"kind": "rotating", "offset": c.offset, "max_size": c.max_size, "keep": c.keep, "idx": c._idx,
             "stored": n, **_dims_of(c.keys, c.values)}
    return entry, ([c.keys[:, :, :n], c.values[:, :, :n]] if n else [])


def _check_rotating(f: Fields, fail: Fail) -> list[Shape]:
    offset, max_size, keep = f.int("offset"), f.int("max_size", lo=1), f.int("keep")
    n, idx, dims = f.int("stored"), f.int("idx"), _dims(f)
    if keep >= max_size or n > offset or idx > n or (dims is None and n):
        raise fail(f"{f.where}: inconsistent window (offset {offset}, size {max_size}, keep {keep}, "
                   f"stored {n}, idx {idx})")
    return _kv_shapes(f.obj, n) if dims else []


def _rebuild_rotating(e: dict, arrays: list):
    c = RotatingKVCache(max_size=e["max_size"], keep=e["keep"])
    if arrays:
        c.keys, c.values = arrays
    c.offset, c._idx = e["offset"], e["idx"]
    return c


# -- ArraysCache (SSM / linear-attention state) -----------------------------------------------
def _write_arrays(c: ArraysCache):
    if c.left_padding is not None or c.lengths is not None:
        raise MlxkvError("cannot save a batched state cache (left padding / lengths set)")
    return {"kind": "arrays", "present": [a is not None for a in c.cache]}, [a for a in c.cache if a is not None]


def _check_arrays(f: Fields, fail: Fail) -> list:
    present = f.get("present")
    if not isinstance(present, list) or not present or not all(isinstance(p, bool) for p in present):
        raise fail(f"{f.where}: 'present' must be a non-empty list of true/false")
    return [None] * sum(present)


def _rebuild_arrays(e: dict, arrays: list):
    c = ArraysCache(len(e["present"]))
    it = iter(arrays)
    c.cache = [next(it) if p else None for p in e["present"]]
    return c


KINDS: dict[str, LayerKind] = {
    k.name: k for k in (
        LayerKind("compressed", CompressedKVCache, _write_compressed, _check_compressed, _rebuild_compressed,
                  _fresh_compressed, _plan_compressed, _tokens_compressed),
        LayerKind("kv", KVCache, _write_kv, _check_kv, _rebuild_kv, lambda e: KVCache(),
                  lambda e, i: LayerPlan(i, "full-attention"), lambda e: e["offset"]),
        LayerKind("rotating", RotatingKVCache, _write_rotating, _check_rotating, _rebuild_rotating,
                  lambda e: RotatingKVCache(max_size=e["max_size"], keep=e["keep"]),
                  lambda e, i: LayerPlan(i, "window", window=e["max_size"], keep=e["keep"]), lambda e: e["stored"]),
        LayerKind("arrays", ArraysCache, _write_arrays, _check_arrays, _rebuild_arrays,
                  lambda e: ArraysCache(len(e["present"])), lambda e, i: LayerPlan(i, "other"), lambda e: None),
    )
}
_BY_TYPE = {k.cls: k for k in KINDS.values()}


def kind_of_cache(cache) -> LayerKind:
    kind = _BY_TYPE.get(type(cache))
    if kind is None:
        raise MlxkvError(f"cannot save a {type(cache).__name__} layer cache (supported: "
                         f"{', '.join(k.cls.__name__ for k in KINDS.values())})")
    return kind


def layer_elements(entry: dict) -> int:
    """Logical K and V elements stored by a layer (0 for state caches)."""
    n = KINDS[entry["kind"]].tokens(entry)
    return _elements(entry, n) if n else 0
