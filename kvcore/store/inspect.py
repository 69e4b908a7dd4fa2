"""What a cache file holds, per layer and in total (mlxkv files and mlx-lm prompt caches)."""

from __future__ import annotations

from pathlib import Path

from ..codecs import CodecSpec, make_codec
from ..errors import MlxkvError
from .file import PREFIX, CacheFile, open_cache_file
from .fingerprint import check_fingerprint, model_fingerprint
from .layers import KINDS, layer_elements
from .mlx_lm_file import inspect_mlx_lm, looks_like_mlx_lm
from .safetensors import open_container
from .sharding import set_paths

SHOW_TOKENS = 16


def _codec_row(spec: dict, dim: int) -> dict:
    s = CodecSpec(spec["codec"], spec["bits"], spec["group_size"])
    codec = make_codec(s, dim)
    return {"codec": s.name, "bits": s.bits, "group_size": s.group_size,
            "layout": getattr(codec, "layout", None) if codec else None}


def _window(size: int, keep: int) -> str:
    return f"window {size}" + (f" (keep {keep})" if keep else "")


def _layer_row(cf: CacheFile, i: int) -> dict:
    e = cf.layers[i]
    nbytes = sum(t.nbytes for t in cf.layer_tensors(i))
    elements = layer_elements(e)
    row = {"layer": i, "cache": e["kind"], "kind": "state", "codec": None, "bits": None, "group_size": None,
           "layout": None, "tokens": None}
    if e["kind"] == "compressed":
        window = _window(e["window"], e["keep"]) if e["window"] else "full"
        D = e["dims"][2] if e["dims"] else 1
        row.update(kind=window, **_codec_row(e["key"], D), start=e["start"], converted=e["converted"])
        if e["value"] != e["key"]:
            row["value_codec"] = CodecSpec(e["value"]["codec"], e["value"]["bits"], e["value"]["group_size"]).label()
        if e.get("recent"):
            row["recent"] = e["recent"]
    elif e["kind"] == "kv":
        row.update(kind="full", codec="full")
    elif e["kind"] == "rotating":
        row.update(kind=_window(e["max_size"], e["keep"]), codec="full")
    if e["kind"] != "arrays":
        row.update(tokens=KINDS[e["kind"]].tokens(e), dtype=e["dtype"])
    row["bytes"] = nbytes
    row["bits_per_element"] = round(8 * nbytes / elements, 3) if elements else None
    row["elements"] = elements
    return row


def _totals(layers: list[dict]) -> dict:
    kv = [r for r in layers if r["elements"]]
    kv_bytes = sum(r["bytes"] for r in kv)
    elements = sum(r["elements"] for r in kv)
    return {"bytes": sum(r["bytes"] for r in layers), "kv_bytes": kv_bytes, "kv_elements": elements,
            "bits_per_element": round(8 * kv_bytes / elements, 3) if elements else None,
            "state_bytes": sum(r["bytes"] for r in layers if not r["elements"])}


def _sharding(cf: CacheFile) -> dict | None:
    if cf.sharding.single:
        return None
    names = set_paths(cf.path, cf.sharding)
    return {**cf.sharding.to_json(), "set": [str(p) for p in names] if names else None}


def inspect_cache(path: str | Path, lm=None) -> dict:
    """A report of `path`; with a loaded model `lm`, also whether it fits and the prefix as text."""
    container = open_container(path)
    if "mlxkv" not in container.metadata and looks_like_mlx_lm(container.metadata):
        report = inspect_mlx_lm(container)
        report.update(file=str(container.path), file_bytes=container.size, totals=_totals(report["layers"]))
        return report
    cf = open_cache_file(path)
    layers = [_layer_row(cf, i) for i in range(len(cf.layers))]
    h = cf.header
    report = {
        "format": f"{h['format']} {h['version']}", "file": str(cf.path), "file_bytes": container.size,
        "mlxkv_version": h["mlxkv_version"], "created": h["created"], "model": h["model"],
        "sharding": _sharding(cf),
        "prefix_tokens": h["prefix_tokens"], "prefix_ids": cf.prefix_ids[:SHOW_TOKENS],
        "layers": layers, "totals": {**_totals(layers), "prefix_bytes": container.tensors[PREFIX].nbytes},
    }
    if lm is not None:
        try:
            check_fingerprint(h["model"], model_fingerprint(lm.model, lm.tokenizer, lm.config))
            sh = cf.sharding
            as_rank = "" if sh.single else f" as {sh.describe()} (continue it under {sh.ranks} ranks)"
            report["model_check"] = f"fits {lm.source}{as_rank}"
        except MlxkvError as e:
            report["model_check"] = f"does not fit {lm.source}: {e}"
        report["prefix_text"] = lm.tokenizer.decode(cf.prefix_ids[:SHOW_TOKENS])
    return report
