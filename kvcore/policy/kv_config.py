"""optiq-style kv_config.json: `[{"layer_idx": 0, "bits": 4, "group_size": 64}, ...]`.

Listed layers are compressed with their bits/group (group_size optional, default 64);
unlisted layers stay full precision. Unknown extra keys are ignored so optiq's files are
read unchanged. mlxkv's extra fields (what `mlxkv calibrate` writes beside optiq's three):
- "codec": a codec other than affine (`turbo`, ...);
- "key_bits" / "value_bits": keys and values at their own widths ("bits" is then optional);
- "recent": the layer's N newest tokens stay full precision (as `--kv .../rN`; default 0).
`{"layer_idx": 3, "codec": "turbo", "key_bits": 4, "value_bits": 3, "recent": 16}`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..codecs import BITS, GROUPS, CodecSpec, codec_names, make_codec
from ..errors import MlxkvError
from .kv_spec import GROUPED

DEFAULT_GROUP = 64


def _int(entry_no: int, key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise MlxkvError(f"kv_config entry {entry_no}: {key} must be an integer, got {value!r}")
    return value


Layers = tuple[tuple[int, CodecSpec, CodecSpec], ...]  # (layer_idx, key codec, value codec)


@dataclass(frozen=True)
class KvConfig:
    """A whole kv_config file: its layers and their recent windows (layers without one: 0)."""

    layers: Layers
    recents: tuple[tuple[int, int], ...] = ()  # (layer_idx, recent) where recent > 0


def parse_kv_config(data, source: str = "kv_config") -> tuple[tuple[int, CodecSpec], ...]:
    """(layer_idx, key codec) per listed layer; `parse_kv_layers` has the value codecs too."""
    return tuple((i, k) for i, k, _ in parse_kv_layers(data, source))


def parse_kv_layers(data, source: str = "kv_config") -> Layers:
    if not isinstance(data, list):
        raise MlxkvError(f"{source}: expected a JSON list of layer entries, got {type(data).__name__}")
    seen: dict[int, int] = {}
    out = []
    for n, entry in enumerate(data):
        if not isinstance(entry, dict):
            raise MlxkvError(f"{source} entry {n}: expected an object, got {entry!r}")
        split = "key_bits" in entry and "value_bits" in entry
        for key in ("layer_idx",) + (() if split else ("bits",)):
            if key not in entry:
                raise MlxkvError(f"{source} entry {n}: missing {key!r}")
        idx = _int(n, "layer_idx", entry["layer_idx"])
        bits = _int(n, "bits", entry["bits"]) if "bits" in entry else None
        kbits = _int(n, "key_bits", entry.get("key_bits", bits))
        vbits = _int(n, "value_bits", entry.get("value_bits", bits))
        group = _int(n, "group_size", entry.get("group_size", DEFAULT_GROUP))
        codec = entry.get("codec", "affine")
        if idx < 0:
            raise MlxkvError(f"{source} entry {n}: layer_idx {idx} is negative")
        if idx in seen:
            raise MlxkvError(f"{source} entry {n}: layer_idx {idx} duplicates entry {seen[idx]}")
        if codec not in codec_names() or codec == "full":
            raise MlxkvError(f"{source} entry {n}: unknown codec {codec!r}")
        for b in {kbits, vbits}:
            if codec == "affine" and b not in BITS:
                raise MlxkvError(f"{source} entry {n} (layer {idx}): bits {b} not in {list(BITS)}")
        if codec == "affine" and group not in GROUPS:
            raise MlxkvError(f"{source} entry {n} (layer {idx}): group_size {group} not in {list(GROUPS)}")
        group = group if codec in GROUPED else None
        specs = CodecSpec(codec, kbits, group), CodecSpec(codec, vbits, group)
        for spec in specs:
            try:
                make_codec(spec, 64)
            except ValueError as e:
                raise MlxkvError(f"{source} entry {n} (layer {idx}): {e}") from None
        seen[idx] = n
        out.append((idx, *specs))
    return tuple(sorted(out))


def parse_kv_file(data, source: str = "kv_config") -> KvConfig:
    layers = parse_kv_layers(data, source)
    recents = []
    for n, entry in enumerate(data):
        r = _int(n, "recent", entry.get("recent", 0))
        if r < 0:
            raise MlxkvError(f"{source} entry {n}: recent {r} is negative")
        if r:
            recents.append((entry["layer_idx"], r))
    return KvConfig(layers, tuple(sorted(recents)))


def load_kv_config(path: str | Path) -> tuple[tuple[int, CodecSpec], ...]:
    """(layer_idx, key codec) per listed layer; `load_kv_layers` has the value codecs too."""
    return tuple((i, k) for i, k, _ in load_kv_layers(path))


def load_kv_layers(path: str | Path) -> Layers:
    return load_kv_file(path).layers


def load_kv_file(path: str | Path) -> KvConfig:
    path = Path(path)
    if not path.is_file():
        raise MlxkvError(f"kv_config file not found: {path}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MlxkvError(f"kv_config {path}: not valid JSON ({e})")
    except RecursionError:
        raise MlxkvError(f"kv_config {path}: nested too deeply to read") from None
    except OSError as e:
        raise MlxkvError(f"kv_config {path}: cannot read it ({e.strerror or e})") from None
    return parse_kv_file(data, source=f"kv_config {path.name}")
