"""The budget a calibration must meet, in bytes of one row's KV at a context, and each option's bytes.

Two forms:
- `--bits B`: bits per element with metadata (every scale, norm and full-precision token counted
  at `dtype_bytes`), at `context` tokens: the bytes may not exceed B/8 x the KV elements stored;
- `--memory M --context C --batch N`: the weights plus N rows of C tokens fit in M.
Bytes come from the one byte model (`kvcore.bench.fit`: `layer_bytes`, `stored_tokens`, `row_bytes`),
which the tests hold against real caches' `nbytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..bench.fit import layer_bytes, row_bytes, stored_tokens
from ..errors import MlxkvError
from ..policy import KVPolicy
from ..units import format_bytes
from .candidates import LayerOption

MAX_BITS = 16.0


@dataclass(frozen=True)
class Budget:
    bits: float | None = None  # bits per element with metadata
    memory: int | None = None  # bytes for the weights and every row's KV
    context: int | None = None  # tokens per row the budget is for (--bits: default the calibration window)
    batch: int = 1
    dtype_bytes: int = 2  # bytes of a full-precision element (a float16/bfloat16 deployment)

    def __post_init__(self):
        if (self.bits is None) == (self.memory is None):
            raise MlxkvError("give one budget: --bits B, or --memory M with --context C")
        if self.bits is not None and not 0 < self.bits <= MAX_BITS:
            raise MlxkvError(f"--bits must be in (0, {MAX_BITS:g}], got {self.bits:g}")
        if self.memory is not None and self.memory <= 0:
            raise MlxkvError(f"--memory must be positive, got {self.memory}")
        if self.memory is not None and self.context is None:
            raise MlxkvError("--memory needs --context (tokens per row the memory must hold)")
        if self.context is not None and self.context < 1:
            raise MlxkvError(f"--context must be >= 1, got {self.context}")
        if self.batch < 1:
            raise MlxkvError(f"--batch must be >= 1, got {self.batch}")
        if self.dtype_bytes not in (1, 2, 4):
            raise MlxkvError(f"--dtype-bytes must be 1, 2 or 4, got {self.dtype_bytes}")

    def describe(self, tokens: int) -> str:
        """`tokens`: the context the budget is counted at (`context`, else the calibration window)."""
        if self.bits is not None:
            return f"{self.bits:g} bits/element at {tokens} tokens"
        return f"{format_bytes(self.memory)} for the weights + {self.batch} x {tokens} tokens"


def option_policy(o: LayerOption) -> KVPolicy:
    """A one-option policy (what a layer's cache is under `o`); mlxkv caches even when full."""
    return KVPolicy(o.key, value_codec=o.value if o.value != o.key else None, recent=o.recent, rollback=0)


def option_bytes(shape, o: LayerOption, tokens: int, dtype_bytes: int) -> int:
    """Bytes one row's cache of a layer of `shape` holds at `tokens` under `o` (mlxkv's caches)."""
    policy = option_policy(o)
    stored = stored_tokens(shape, policy, tokens)
    return layer_bytes(shape, o.key, o.value, stored, dtype_bytes, o.recent)


def layer_elements(shape, tokens: int) -> int:
    """K and V elements one row of a layer of `shape` stores at `tokens` (mlxkv's caches)."""
    return stored_tokens(shape, option_policy(LayerOption()), tokens) * shape.kv_heads * 2 * shape.head_dim


def budget_bytes(budget: Budget, shapes: list, layers: list[int], weights: int, tokens: int) -> int:
    """The most KV bytes one row of `tokens` may take over the calibrated `layers`."""
    if budget.bits is not None:
        elements = sum(layer_elements(shapes[i], tokens) for i in layers)
        return int(budget.bits * elements / 8)
    free = budget.memory - weights
    if free <= 0:
        raise MlxkvError(f"--memory {format_bytes(budget.memory)} is below the model's weights "
                         f"({format_bytes(weights)}): nothing is left for the KV cache")
    return free // budget.batch


def config_bytes(shapes: list, policy: KVPolicy, tokens: int, dtype_bytes: int) -> int:
    """One row's KV bytes under a whole config (the byte model's `row_bytes`)."""
    return row_bytes(shapes, policy, tokens, dtype_bytes)
