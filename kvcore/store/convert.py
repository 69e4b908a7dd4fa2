"""Re-encode a cache file under another KV policy, one layer at a time.

Each attention layer is decoded to dense K/V, rebuilt as a CompressedKVCache with the target
codec and converted at its current length (as a run with `--quantized-kv-start` = the prefix
length would have been), then evaluated, so the transient is one layer. State layers (SSM)
are copied. With a target that compresses nothing, mlx-lm caches stay as they are.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from ..cache import CompressedKVCache
from ..cache.layout import DTYPES
from ..codecs import CodecSpec, make_codec
from ..errors import MlxkvError
from ..policy import KVPolicy
from .atomic import check_target
from .file import open_cache_file, save_cache
from .sharding import Sharding, set_paths


@dataclass
class ConvertResult:
    bytes_before: int  # layer arrays (KV and state) in the input
    bytes_after: int
    file_bytes: int
    notices: list[str] = field(default_factory=list)


def _dense(e: dict, parts: list) -> tuple[tuple | None, tuple | None, int]:
    """Layer `e`'s tokens as dense (sink k, v), (rest k, v) and the position rest starts at."""
    if e["kind"] == "kv":
        return None, tuple(parts) or None, 0
    if e["kind"] == "rotating":
        return _rotating_dense(e, parts)
    lo, hi = (2 if e["sink"] else 0), len(parts) - (2 if e["tail"] else 0)
    rest = []
    if e["enc"]:
        _, _, D, Dv = e["dims"]
        dtype, kp = getattr(mx, e["dtype"]), e["key_parts"]
        kc = make_codec(CodecSpec(**_spec_args(e["key"])), D)
        vc = make_codec(CodecSpec(**_spec_args(e["value"])), Dv)
        rest.append((kc.decode(tuple(parts[lo : lo + kp]), dtype), vc.decode(tuple(parts[lo + kp : hi]), dtype)))
    if e["tail"]:
        rest.append(tuple(parts[hi:]))
    if len(rest) > 1:  # (a lone part is used as it is: no second copy of the layer)
        joined = tuple(mx.concatenate([r[j] for r in rest], axis=2) for j in (0, 1))
    else:
        joined = rest[0] if rest else None
    return (tuple(parts[:lo]) or None), joined, e["enc_start"] if e["enc"] else e["tail_start"]


def _rotating_dense(e: dict, parts: list):
    """mlx-lm's RotatingKVCache buffer in temporal order (its `_temporal_order`), split at keep."""
    if not parts:
        return None, None, e["offset"]
    n, idx, keep = parts[0].shape[2], e["idx"], e["keep"]

    def ordered(x):
        if idx == n:
            return x
        if idx < e["offset"]:
            return mx.concatenate([x[:, :, :keep], x[:, :, idx:], x[:, :, keep:idx]], axis=2)
        return x[:, :, :idx]

    k, v = (ordered(p) for p in parts)
    n_sink = min(keep, k.shape[2])
    sink = (k[:, :, :n_sink], v[:, :, :n_sink]) if n_sink else None
    rest = (k[:, :, n_sink:], v[:, :, n_sink:]) if k.shape[2] > n_sink else None
    return sink, rest, e["offset"] - (rest[0].shape[2] if rest else 0)


def _spec_args(d: dict) -> dict:
    return {"name": d["codec"], "bits": d["bits"], "group_size": d["group_size"]}


def _window(e: dict) -> tuple[int | None, int]:
    if e["kind"] == "rotating":
        return e["max_size"], e["keep"]
    return (e["window"], e["keep"]) if e["kind"] == "compressed" else (None, 0)


def _rebuild(i: int, e: dict, parts: list, spec: CodecSpec, value_spec: CodecSpec | None = None,
             recent: int = 0) -> CompressedKVCache:
    sink, rest, stored_from = _dense(e, parts)
    window, keep = _window(e)
    offset = e["offset"]
    stored_from = max(stored_from, keep) if window else 0
    dims = (*e["dims"], DTYPES[e["dtype"]])
    c = CompressedKVCache.from_dense(spec, value_spec or spec, offset, dims, sink, rest, window, keep, recent, stored_from)
    bt = c.block_tokens
    if window and (stored_from - keep) % bt:
        raise MlxkvError(f"layer {i}: a wrapped mlx-lm sliding window cannot take a codec that groups {bt} "
                         f"tokens (head_dim {e['dims'][2]} is not a multiple of the group); choose a group "
                         f"that divides it")
    c.convert()
    return c


def _precision(spec: CodecSpec | None) -> tuple[int, int]:
    """Order codecs by information kept: (bits, -group); full precision is highest."""
    return (99, 0) if spec is None or not spec.compresses else (spec.bits, -(spec.group_size or 0))


def _stored_spec(e: dict) -> CodecSpec | None:
    """The codec the layer's data went through (None: all dense)."""
    return CodecSpec(**_spec_args(e["key"])) if e["kind"] == "compressed" and e["enc"] else None


def _rank_notice(src: Path, dst: Path, sharding: Sharding) -> str:
    names = set_paths(dst, sharding)
    r, n = sharding.rank, sharding.ranks
    todo = (f"convert the other ranks' files with the same flags to {', '.join(str(p) for p in names if p != dst)}"
            if names else f"name it <name>.rank{r}-of-{n}{dst.suffix} beside rank 0's <name>{dst.suffix}")
    return f"{src} holds {sharding.describe()}'s KV heads, and so does {dst}: {todo}, so that they load together"


def _same_file(src: Path, dst: Path) -> bool:
    try:
        return os.path.samefile(src, dst)
    except OSError:  # dst does not exist (or cannot be reached): not the input
        return os.path.abspath(src) == os.path.abspath(dst)


def convert_cache_file(src: str | Path, dst: str | Path, policy: KVPolicy) -> ConvertResult:
    src, dst = Path(src), Path(dst)
    cf = open_cache_file(src)  # a missing, looping or non-regular input is refused here, by name
    if _same_file(src, dst):
        raise MlxkvError(f"convert-kv writes a new file: the output {dst} is the input")
    check_target(dst)
    n_layers = len(cf.layers)
    for idx, _ in policy.layer_codecs or ():
        if idx >= n_layers or cf.layers[idx]["kind"] == "arrays":
            raise MlxkvError(f"kv_config: layer_idx {idx} is not an attention layer of this cache "
                             f"({n_layers} layers)")
    arrays, out, raised = cf.arrays(), [], []
    for i, e in enumerate(cf.layers):
        names = [t.name for t in cf.layer_tensors(i)]
        parts = [arrays.pop(n) for n in names]  # released as soon as this layer is rebuilt
        spec = policy.codec_for(i)
        if e["kind"] == "arrays" or (not policy.compresses and e["kind"] != "compressed"):
            out.append(cf.restore_layer(i, dict(zip(names, parts))))
            continue
        if _precision(spec) > _precision(_stored_spec(e)) and _stored_spec(e) is not None:
            raised.append(i)
        out.append(_rebuild(i, e, parts, spec, policy.value_codec_for(i), policy.recent_for(i)))
        mx.eval(out[-1].state)
        del parts
    notices = []
    if raised:
        notices.append(f"layers {', '.join(map(str, raised))} were stored at lower precision; re-encoding them "
                       f"higher does not restore the information already lost")
    sharding = cf.sharding
    if not sharding.single:
        notices.append(_rank_notice(src, dst, sharding))
    size = save_cache(dst, out, cf.prefix_ids, cf.fingerprint, sharding)
    return ConvertResult(cf.kv_bytes(), open_cache_file(dst).kv_bytes(), size, notices)
