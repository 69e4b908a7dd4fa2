"""Profiles: TOML presets of KV settings (profiles/*.toml or any path).

Schema (every key optional):
```toml
description = "4-bit affine KV from the first token"
[kv]
kv = "turbo:k4v3"     # a --kv value (kv_spec.py): replaces codec/bits/group_size/kv_config
codec = "affine"      # "full" | "affine" | "turbo"
bits = 4              # 2 3 4 5 6 8
group_size = 64       # 32 64 128
start = 0             # quantized-kv-start: tokens kept full precision before converting
window = 0            # max-kv-size: sliding window for every layer (0 = none)
keep = 4              # tokens at the start kept in a window (attention sink)
kv_config = "x.json"  # optiq-style per-layer file, relative to the profile
```
"""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from ..errors import MlxkvError

PROFILE_DIR = Path(__file__).resolve().parents[1] / "profiles"
KEYS = {"kv": str, "codec": str, "bits": int, "group_size": int, "start": int, "window": int, "keep": int,
        "kv_config": str}


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def _find(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.exists():
        if not p.is_file():
            raise MlxkvError(f"profile file not found: {p}")
        return p
    p = PROFILE_DIR / f"{name_or_path}.toml"
    if not p.is_file():
        raise MlxkvError(f"unknown profile {name_or_path!r} (known: {', '.join(profile_names())})")
    return p


def load_profile(name_or_path: str) -> dict:
    """The profile's [kv] table, validated; kv_config made absolute."""
    path = _find(name_or_path)
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise MlxkvError(f"profile {path.name}: not valid TOML ({e})")
    except RecursionError:
        raise MlxkvError(f"profile {path.name}: nested too deeply to read") from None
    except OSError as e:
        raise MlxkvError(f"profile {path}: cannot read it ({e.strerror or e})") from None
    for key in data:
        if key not in ("description", "kv"):
            raise MlxkvError(f"profile {path.name}: unknown key {key!r}")
    kv = data.get("kv", {})
    if not isinstance(kv, dict):
        raise MlxkvError(f"profile {path.name}: 'kv' must be a table")
    for key, value in kv.items():
        if key not in KEYS:
            raise MlxkvError(f"profile {path.name}: unknown key 'kv.{key}'")
        typ = KEYS[key]
        if isinstance(value, bool) or not isinstance(value, typ):
            raise MlxkvError(f"profile {path.name}: 'kv.{key}' must be {typ.__name__}, got {value!r}")
        if typ is int and value < (1 if key in ("bits", "group_size") else 0):
            raise MlxkvError(f"profile {path.name}: 'kv.{key}' must be >= {1 if key in ('bits', 'group_size') else 0}, "
                             f"got {value}")
    if "kv_config" in kv:
        kv = {**kv, "kv_config": str((path.parent / kv["kv_config"]).resolve())}
    return kv
