"""The codec interface: how a cache turns K or V tokens into stored arrays and back.

A codec encodes `x: (B, H, T, D)` with `T % block_tokens == 0` into a tuple of arrays whose
axis 2 counts blocks of `block_tokens` tokens, so caches can slice, concatenate and drop
encoded data along axis 2 without knowing what the arrays mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

Encoded = tuple  # tuple[mx.array, ...], block axis 2


@dataclass(frozen=True)
class CodecSpec:
    """What a user asked for: codec name and its parameters (hashable, JSON-friendly)."""

    name: str = "full"
    bits: int | None = None
    group_size: int | None = None

    @property
    def compresses(self) -> bool:
        return self.name != "full"

    def label(self) -> str:
        if self.name == "full":
            return "full"
        return f"{self.name}:{self.bits}" + (f"/g{self.group_size}" if self.group_size else "")

    def to_json(self) -> dict:
        return {"codec": self.name, "bits": self.bits, "group_size": self.group_size}


class Codec(Protocol):
    spec: CodecSpec
    head_dim: int
    block_tokens: int  # tokens per encoded block (1 = each token on its own)

    def encode(self, x: mx.array) -> Encoded: ...

    def decode(self, enc: Encoded, dtype: mx.Dtype) -> mx.array: ...

    def bytes_per_token(self, n_heads: int) -> float:
        """Stored bytes per token for one of K or V across `n_heads` heads."""
        ...

    def describe(self) -> dict: ...
