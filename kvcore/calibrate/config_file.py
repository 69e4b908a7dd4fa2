"""The kv_config a calibration writes, and the policy `--kv-config` reads back from it.

Plain affine layers (keys and values alike, no recent window) are written exactly as optiq
writes them, `{"layer_idx": i, "bits": b, "group_size": g}`, and the file is laid out as
optiq's `json.dump(..., indent=2)`; other choices add the fields `kvcore.policy.kv_config`
documents (`codec`, `key_bits`/`value_bits`, `recent`). Full-precision layers are not listed.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from ..policy import KVOptions, KVPolicy, resolve_policy
from .candidates import LayerOption


def entry(layer: int, o: LayerOption) -> dict | None:
    """One kv_config entry for layer `layer` under `o` (None: full precision, unlisted)."""
    if not o.compresses:
        return None
    k, v = o.key, o.value
    if k.name == "affine" and k == v and not o.recent:
        return {"layer_idx": layer, "bits": k.bits, "group_size": k.group_size}
    e: dict = {"layer_idx": layer, "codec": k.name}
    if k.bits == v.bits:
        e["bits"] = k.bits
    else:
        e["key_bits"], e["value_bits"] = k.bits, v.bits
    if k.group_size is not None:
        e["group_size"] = k.group_size
    if o.recent:
        e["recent"] = o.recent
    return e


def config_entries(choices: dict[int, LayerOption]) -> list[dict]:
    return [e for i in sorted(choices) if (e := entry(i, choices[i])) is not None]


def config_text(entries: list[dict]) -> str:
    """The file's text, byte for byte as optiq writes its kv_config.json."""
    return json.dumps(entries, indent=2)


def config_policy(entries: list[dict]) -> KVPolicy:
    """The policy `--kv-config` makes of these entries (through a file, as a user's run reads it)."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "kv_config.json"
        path.write_text(config_text(entries))
        return resolve_policy(KVOptions(kv=f"config:{path}", quantized_kv_start=0))


def uniform_choices(layers: list[int], o: LayerOption) -> dict[int, LayerOption]:
    return {i: o for i in layers}
