"""What fits: from config shapes alone (no weights loaded), the largest context per batch and
the largest batch per context for each KV scheme under a memory budget."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..policy import KVPolicy
from ..policy.kv_config import load_kv_config


@dataclass(frozen=True)
class LayerShape:
    kind: str  # "full-attention" | "window" | "other" (SSM state or a KV-shared layer: no KV of its own)
    window: int | None
    kv_heads: int
    head_dim: int


def layer_shapes(config: dict) -> list[LayerShape]:
    """Per layer, from config.json alone: sliding windows (Gemma), KV-shared layers (Gemma 4),
    linear-attention layers (Qwen3.5 / Qwen3-Next), global head dims (Gemma 4)."""
    c = config.get("text_config", config)
    n, heads = c["num_hidden_layers"], c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    hd = c.get("head_dim") or c["hidden_size"] // heads
    window, pattern, types = c.get("sliding_window"), c.get("sliding_window_pattern"), c.get("layer_types")
    shared = c.get("num_kv_shared_layers", 0)
    interval = c.get("full_attention_interval")
    out = []
    for i in range(n):
        if i >= n - shared or (interval and (i + 1) % interval != 0):
            out.append(LayerShape("other", None, 0, 0))
            continue
        if types is not None:
            sliding = types[i] == "sliding_attention"
        else:
            sliding = bool(window and pattern and (i + 1) % pattern != 0)
        if sliding:
            out.append(LayerShape("window", window, kv, hd))
        else:
            out.append(LayerShape("full-attention", None, c.get("num_global_key_value_heads") or kv,
                                  c.get("global_head_dim") or hd))
    return out


def _bytes_per_element(spec, dtype_size: int) -> float:
    return dtype_size if not spec.compresses else ((spec.bits or 8) + 32 / (spec.group_size or 64)) / 8


def row_bytes(shapes: list[LayerShape], policy: KVPolicy, tokens: int, dtype_size: int = 2) -> int:
    """KV bytes of one row holding `tokens` tokens (windows capped; --max-kv-size applies to
    full-attention layers)."""
    total = 0.0
    for i, s in enumerate(shapes):
        if s.kind == "other":
            continue
        window = s.window or policy.max_kv_size
        t = min(tokens, window) if window else tokens
        total += t * s.kv_heads * s.head_dim * 2 * _bytes_per_element(policy.codec_for(i), dtype_size)
    return int(total)


def weight_bytes_from_files(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))


@dataclass(frozen=True)
class FitRow:
    scheme: str
    batch: int | None
    context: int | None
    max_context: int | None = None
    max_batch: int | None = None

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


def fit_table(config: dict, policies: dict[str, KVPolicy], budget: int, weights: int, batches, contexts,
              dtype_size: int = 2) -> list[FitRow]:
    free = max(0, budget - weights)
    limit = config.get("text_config", config).get("max_position_embeddings", 131072)
    shapes = layer_shapes(config)
    rows = []
    for name, policy in policies.items():
        for b in batches:
            rows.append(FitRow(name, b, None, max_context=max_context(shapes, policy, free, b, dtype_size, limit)))
        for ctx in contexts:
            per_row = row_bytes(shapes, policy, ctx, dtype_size)
            rows.append(FitRow(name, None, ctx, max_batch=free // per_row if per_row else None))
    return rows


def policy_with_kv_config(path: str) -> KVPolicy:
    return KVPolicy(layer_codecs=load_kv_config(path), start=0, source="kv_config")
