"""Codec registry: names map to codec classes; caches only see the Codec protocol."""

from __future__ import annotations

from .affine import BITS, GROUPS, AffineCodec
from .base import Codec, CodecSpec, Encoded
from .turbo import TurboCodec

_REGISTRY: dict[str, type] = {"affine": AffineCodec, "turbo": TurboCodec}

FULL = CodecSpec("full")


def register_codec(name: str, cls: type) -> None:
    _REGISTRY[name] = cls


def codec_names() -> tuple[str, ...]:
    return ("full", *_REGISTRY)


def make_codec(spec: CodecSpec, head_dim: int) -> Codec | None:
    """The codec for `spec` at this head_dim; None for full precision."""
    if not spec.compresses:
        return None
    try:
        cls = _REGISTRY[spec.name]
    except KeyError:
        raise ValueError(f"unknown KV codec {spec.name!r} (known: {', '.join(codec_names())})")
    return cls(spec, head_dim)


__all__ = ["BITS", "GROUPS", "FULL", "AffineCodec", "TurboCodec", "Codec", "CodecSpec", "Encoded", "make_codec",
           "register_codec", "codec_names"]
