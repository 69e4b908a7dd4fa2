"""What fits: from config shapes alone (no weights loaded), the largest context per batch and
the largest batch per context for each KV scheme under a memory budget."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..cache.bytes import LayerShape, layer_bytes, layer_shapes
from ..cache.compressed import TRIM_STEP
from ..policy import KVPolicy

__all__ = ["LayerShape", "layer_bytes", "layer_shapes", "stored_tokens", "row_bytes", "fit_table", "max_context"]


def stored_tokens(s: LayerShape, policy: KVPolicy, tokens: int) -> int:
    """Tokens layer `s` of one row holds at most, `tokens` into a run: windows are capped at the
    window (mlx-lm's caches), or at the window plus TRIM_STEP - 1 (and rollback spares) for
    mlxkv's, which drop old tokens TRIM_STEP at a time; --max-kv-size windows full-attention layers."""
    window = s.window or policy.max_kv_size
    if not window:
        return tokens
    if policy.active:
        window += TRIM_STEP - 1 + (policy.rollback or 0)
    return min(tokens, window)


def row_bytes(shapes: list[LayerShape], policy: KVPolicy, tokens: int, dtype_size: int = 2) -> int:
    """KV bytes of one row holding `tokens` tokens (`stored_tokens` per layer; the first `keep`
    tokens of a --max-kv-size window stay dense)."""
    total = 0
    for i, s in enumerate(shapes):
        if s.kind == "other":
            continue
        keep = policy.keep if s.window is None and policy.max_kv_size else 0
        t = stored_tokens(s, policy, tokens)
        total += layer_bytes(s, policy.codec_for(i), policy.value_codec_for(i), t, dtype_size, policy.recent_for(i), keep)
    return total


def weight_bytes_from_files(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))


@dataclass(frozen=True)
class FitRow:
    scheme: str
    batch: int | None
    context: int | None
    max_context: int | None = None
    max_batch: int | None = None
    peak: int | None = None  # context rows: one row's predicted peak (weights + KV + one layer's prefill transient)
    chunk: int | None = None  # ... and the prefill chunk the budget allows it

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def max_context(shapes, policy: KVPolicy, budget_kv: int, batch: int, dtype_size: int, limit: int) -> int:
    """Largest context (tokens per row, <= limit) whose KV for `batch` rows fits budget_kv."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if batch * row_bytes(shapes, policy, mid, dtype_size) <= budget_kv:
            lo = mid
        else:
            hi = mid - 1
    return lo


def prefill_transient(config: dict, policy: KVPolicy, context: int, weights: int, kv: int, budget: int,
                      dtype_size: int) -> tuple[int, int] | None:
    """(one layer's prefill transient, the chunk) of a `context`-token prompt under `budget`
    (kvcore.transient's plan, as the jobs run it); None where not even the smallest chunk fits."""
    from ..errors import MlxkvError
    from ..transient import plan_prefill

    try:
        plan = plan_prefill(config, policy, context, weights, kv, budget, dtype_size)
    except MlxkvError:
        return None
    return plan.transient.total, plan.chunk


def fit_table(config: dict, policies: dict[str, KVPolicy], budget: int, weights: int, batches, contexts,
              dtype_size: int = 2) -> list[FitRow]:
    """Per scheme: the longest context for each batch and the largest batch for each context
    (their KV beside the weights), and for each context one row's predicted peak: weights + KV +
    one layer's prefill transient at the chunk the budget allows (what a run's peak holds)."""
    free = max(0, budget - weights)
    limit = config.get("text_config", config).get("max_position_embeddings", 131072)
    shapes = layer_shapes(config)
    rows = []
    for name, policy in policies.items():
        for b in batches:
            rows.append(FitRow(name, b, None, max_context=max_context(shapes, policy, free, b, dtype_size, limit)))
        for ctx in contexts:
            per_row = row_bytes(shapes, policy, ctx, dtype_size)
            t = prefill_transient(config, policy, ctx, weights, per_row, budget, dtype_size)
            rows.append(FitRow(name, None, ctx, max_batch=free // per_row if per_row else None,
                               peak=weights + per_row + t[0] if t else None, chunk=t[1] if t else None))
    return rows
