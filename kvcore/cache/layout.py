"""The typed layout a CompressedKVCache publishes (what packing, storage and byte counting read)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


@dataclass(frozen=True)
class Layout:
    """How a CompressedKVCache stores a token, once its dimensions are known: what packing rows
    together, storage and byte counting read instead of the cache's private fields."""

    batch: int
    heads: int
    head_dim: int
    value_dim: int
    dtype: mx.Dtype
    key_parts: int | None  # encoded arrays per key (None: nothing encoded yet)
    joint: bool  # K and V in one set of encoded arrays (view.Joint)
    block_tokens: int
