"""Flags + profile + kv_config -> one KVPolicy (flags override the profile)."""

from __future__ import annotations

from dataclasses import dataclass

from ..codecs import FULL, CodecSpec
from .kv_config import load_kv_config
from .plan import MLX_LM_DEFAULT_START, KVPolicy
from .profile import load_profile


@dataclass
class KVOptions:
    """Raw user choices; None means "not given"."""

    kv_bits: int | None = None
    kv_group_size: int | None = None
    quantized_kv_start: int | None = None
    kv_config: str | None = None
    max_kv_size: int | None = None
    keep: int | None = None
    profile: str | None = None


def resolve_policy(o: KVOptions) -> KVPolicy:
    prof = load_profile(o.profile) if o.profile else {}
    name = prof.get("codec", "affine" if prof.get("bits") else "full")
    bits = o.kv_bits if o.kv_bits is not None else prof.get("bits")
    group = o.kv_group_size or prof.get("group_size") or 64
    kv_config = o.kv_config or prof.get("kv_config")
    window = o.max_kv_size if o.max_kv_size is not None else (prof.get("window") or None)
    keep = o.keep if o.keep is not None else prof.get("keep", 4)
    if o.kv_bits is not None and name == "full":
        name = "affine"
    codec = CodecSpec(name, bits, group) if bits is not None and name != "full" else FULL
    layer_codecs = load_kv_config(kv_config) if kv_config else None
    start = o.quantized_kv_start if o.quantized_kv_start is not None else prof.get("start")
    if start is None:
        start = 0 if layer_codecs is not None else MLX_LM_DEFAULT_START
    source = "kv_config" if layer_codecs is not None else ("profile" if prof else "flags")
    return KVPolicy(codec, start, window, keep, layer_codecs, source)
