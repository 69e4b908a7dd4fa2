"""Flags + profile + kv_config -> one KVPolicy (flags override the profile)."""

from __future__ import annotations

from dataclasses import dataclass

from ..codecs import FULL, CodecSpec
from ..errors import MlxkvError
from .companions import check_companions
from .kv_config import load_kv_file
from .kv_spec import GROUPED, KvScheme, parse_kv
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
    kv: str | None = None  # the --kv vocabulary (kv_spec.py); excludes kv_bits/kv_group_size/kv_config


def _scheme(o: KVOptions, prof: dict) -> KvScheme | None:
    """The `--kv` scheme in force: the flag, else the profile's unless short flags override it."""
    if o.kv is not None:
        if o.kv_bits is not None or o.kv_group_size is not None or o.kv_config:
            raise MlxkvError("--kv names the whole KV scheme: drop --kv-bits, --kv-group-size and --kv-config "
                             "(e.g. --kv affine:4/g32, --kv config:FILE)")
        return parse_kv(o.kv)
    if "kv" in prof and o.kv_bits is None and not o.kv_config:
        return parse_kv(prof["kv"])
    return None


def _layers(path: str) -> tuple[tuple, tuple | None, tuple | None]:
    """(layer_codecs, layer_value_codecs or None, layer recent windows or None) of a kv_config file."""
    config = load_kv_file(path)
    values = tuple((i, v) for i, k, v in config.layers if v != k)
    return tuple((i, k) for i, k, _ in config.layers), values or None, config.recents or None


def resolve_policy(o: KVOptions) -> KVPolicy:
    prof = load_profile(o.profile) if o.profile else {}
    check_companions(o, prof)
    window = o.max_kv_size if o.max_kv_size is not None else (prof.get("window") or None)
    keep = o.keep if o.keep is not None else prof.get("keep", 4)
    scheme = _scheme(o, prof)
    if scheme is not None:  # compresses from the first token unless a start is given
        layer_codecs, layer_values, recents = _layers(scheme.config) if scheme.config else (None, None, None)
        start = o.quantized_kv_start if o.quantized_kv_start is not None else prof.get("start", 0)
        values = scheme.value if scheme.value != scheme.key else None
        source = "kv_config" if layer_codecs is not None else "flags" if o.kv is not None else "profile"
        return KVPolicy(scheme.key, start, window, keep, layer_codecs, source, value_codec=values,
                        layer_value_codecs=layer_values, recent=scheme.recent, layer_recent=recents)
    name = prof.get("codec", "affine" if prof.get("bits") is not None else "full")
    bits = o.kv_bits if o.kv_bits is not None else prof.get("bits")
    if name != "full" and bits is None:
        raise MlxkvError(f"profile {o.profile}: codec {name!r} needs bits (kv.bits, or --kv-bits)")
    group = o.kv_group_size if o.kv_group_size is not None else prof.get("group_size") or 64
    kv_config = o.kv_config or prof.get("kv_config")
    if o.kv_bits is not None and name == "full":
        name = "affine"
    group = group if name in GROUPED else None
    codec = CodecSpec(name, bits, group) if bits is not None and name != "full" else FULL
    layer_codecs, layer_values, recents = _layers(kv_config) if kv_config else (None, None, None)
    start = o.quantized_kv_start if o.quantized_kv_start is not None else prof.get("start")
    if start is None:
        start = 0 if layer_codecs is not None else MLX_LM_DEFAULT_START
    source = "kv_config" if layer_codecs is not None else ("profile" if prof else "flags")
    return KVPolicy(codec, start, window, keep, layer_codecs, source, layer_value_codecs=layer_values,
                    layer_recent=recents)
