"""Read-only view of mlx-lm's own prompt-cache files (`save_prompt_cache`), for inspect-cache.

mlx-lm flattens `[metadata, class names, scalars]` into the safetensors metadata and each
cache's `state` into arrays named by tree path:
```
metadata  "0.<key>": user metadata   "1.<i>": class of cache i   "2.0": ""   "2.<k>.0/1": scalar path, type
arrays    "<i>.<j>" (nested: "<i>.<j>.<k>"), scalars saved as 0-d arrays
```
(older mlx-lm: "0.<i>.<j>" meta_state strings, "1.<key>" metadata, "2.<i>" classes). Class
names are labels here: they choose a describer from a table, never code to run.
"""

from __future__ import annotations

import re

from .safetensors import Container, Tensor

_PATH = re.compile(r"^\d+\.")  # tree paths: "<index>.<rest>"


def looks_like_mlx_lm(metadata: dict[str, str]) -> bool:
    return all(_PATH.match(k) for k in metadata) and ("1.0" in metadata or "2.0" in metadata)


def _layout(metadata: dict[str, str]) -> tuple[dict[int, str], dict[int, list[str]] | None]:
    """(class name per cache, meta_state strings per cache: None in current files)."""
    if metadata.get("2.0") == "":  # current layout
        classes = {int(k[2:]): v for k, v in metadata.items() if re.fullmatch(r"1\.\d+", k)}
        return classes, None
    classes = {int(k[2:]): v for k, v in metadata.items() if re.fullmatch(r"2\.\d+", k)}
    meta: dict[int, list[str]] = {}
    for k, v in sorted(metadata.items()):
        m = re.fullmatch(r"0\.(\d+)(?:\.(\d+))?", k)
        if m:
            meta.setdefault(int(m[1]), []).append(v)
    return classes, meta


def _scalar(c: Container, t: Tensor | None) -> int | None:
    if t is None or t.shape != () or t.dtype not in ("int32", "int64", "uint32", "uint64"):
        return None
    return int.from_bytes(c.read(t), "little", signed=t.dtype.startswith("int"))


def _meta_int(meta: list[str], i: int) -> int | None:
    try:
        return int(meta[i])
    except (IndexError, ValueError):
        return None


def _dims(t: Tensor | None) -> tuple[int, int, int] | None:
    return None if t is None or len(t.shape) != 4 else (t.shape[0], t.shape[1], t.shape[3])


def _describe(name: str, c: Container, own: dict[str, Tensor], meta: list[str] | None, i: int) -> dict:
    """kind, tokens and elements of one cache, by what its class stores (meta: old files only)."""
    old = meta is not None
    arr = lambda j: own.get(f"{i}.{j}")  # noqa: E731
    row = {"kind": "unknown", "codec": None, "bits": None, "group_size": None, "tokens": None, "elements": 0}
    if name in ("KVCache", "RotatingKVCache"):
        k, v = arr(0), arr(1)
        if _dims(k) is None or _dims(v) is None:
            return row
        if old:  # old files: RotatingKVCache's meta_state is (keep, max_size, offset, idx); KVCache's ""
            offset = _meta_int(meta, 2) if name == "RotatingKVCache" else None
        else:
            offset = _scalar(c, arr(2))
        tokens = offset if offset is not None else k.shape[2]
        row.update(kind="full", codec="full", tokens=tokens)
        if name == "RotatingKVCache":
            size = _meta_int(meta, 1) if old else _scalar(c, arr(4))
            row.update(kind=f"window {size}", tokens=min(tokens, size) if size else tokens)
        B, H, D = _dims(k)
        row["elements"] = row["tokens"] * B * H * (D + v.shape[3])
    elif name == "QuantizedKVCache":
        k0, v0 = own.get(f"{i}.0.0"), own.get(f"{i}.1.0")
        if old:  # meta_state (offset, group_size, bits)
            offset, group, bits = _meta_int(meta, 0), _meta_int(meta, 1), _meta_int(meta, 2)
        else:
            offset, group, bits = _scalar(c, arr(2)), _scalar(c, arr(3)), _scalar(c, arr(4))
        row.update(kind="full", codec="affine", bits=bits, group_size=group, tokens=offset)
        if bits and offset is not None and _dims(k0) and _dims(v0):
            B, H, wk = _dims(k0)
            row["elements"] = offset * B * H * (wk + v0.shape[3]) * 32 // bits
    elif name in ("ArraysCache", "MambaCache"):
        row.update(kind="state", codec="full")
    return row


def inspect_mlx_lm(c: Container) -> dict:
    classes, meta = _layout(c.metadata)
    layers = []
    for i in sorted(classes):
        own = {n: t for n, t in c.tensors.items() if n.split(".", 1)[0] == str(i)}
        name = classes[i][:64]
        row = _describe(name, c, own, None if meta is None else meta.get(i, []), i)
        nbytes = sum(t.nbytes for t in own.values())
        bpe = round(8 * nbytes / row["elements"], 3) if row["elements"] else None
        layers.append({"layer": i, "cache": name, **row, "bytes": nbytes, "bits_per_element": bpe})
    user_prefix = "0." if meta is None else "1."
    user = {k[2:]: v for k, v in c.metadata.items() if k.startswith(user_prefix)}
    return {"format": "mlx-lm prompt cache", "layers": layers, "metadata": user,
            "note": "mlx-lm stores preallocated capacity too; bytes are what the file holds"}
