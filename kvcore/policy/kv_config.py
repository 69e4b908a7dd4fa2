"""optiq-style kv_config.json: `[{"layer_idx": 0, "bits": 4, "group_size": 64}, ...]`.

Listed layers are compressed with their bits/group (group_size optional, default 64);
unlisted layers stay full precision. Unknown extra keys are ignored so optiq's files are
read unchanged; an optional "codec" key names a codec other than affine.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..codecs import BITS, GROUPS, CodecSpec, codec_names
from ..errors import MlxkvError

DEFAULT_GROUP = 64


def _int(entry_no: int, key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise MlxkvError(f"kv_config entry {entry_no}: {key} must be an integer, got {value!r}")
    return value


def parse_kv_config(data, source: str = "kv_config") -> tuple[tuple[int, CodecSpec], ...]:
    if not isinstance(data, list):
        raise MlxkvError(f"{source}: expected a JSON list of layer entries, got {type(data).__name__}")
    seen: dict[int, int] = {}
    out = []
    for n, entry in enumerate(data):
        if not isinstance(entry, dict):
            raise MlxkvError(f"{source} entry {n}: expected an object, got {entry!r}")
        for key in ("layer_idx", "bits"):
            if key not in entry:
                raise MlxkvError(f"{source} entry {n}: missing {key!r}")
        idx = _int(n, "layer_idx", entry["layer_idx"])
        bits = _int(n, "bits", entry["bits"])
        group = _int(n, "group_size", entry.get("group_size", DEFAULT_GROUP))
        codec = entry.get("codec", "affine")
        if idx < 0:
            raise MlxkvError(f"{source} entry {n}: layer_idx {idx} is negative")
        if idx in seen:
            raise MlxkvError(f"{source} entry {n}: layer_idx {idx} duplicates entry {seen[idx]}")
        if codec not in codec_names() or codec == "full":
            raise MlxkvError(f"{source} entry {n}: unknown codec {codec!r}")
        if codec == "affine" and bits not in BITS:
            raise MlxkvError(f"{source} entry {n} (layer {idx}): bits {bits} not in {list(BITS)}")
        if codec == "affine" and group not in GROUPS:
            raise MlxkvError(f"{source} entry {n} (layer {idx}): group_size {group} not in {list(GROUPS)}")
        seen[idx] = n
        out.append((idx, CodecSpec(codec, bits, group)))
    return tuple(sorted(out))


def load_kv_config(path: str | Path) -> tuple[tuple[int, CodecSpec], ...]:
    path = Path(path)
    if not path.is_file():
        raise MlxkvError(f"kv_config file not found: {path}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MlxkvError(f"kv_config {path}: not valid JSON ({e})")
    return parse_kv_config(data, source=f"kv_config {path.name}")
