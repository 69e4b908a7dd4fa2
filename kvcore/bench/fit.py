"""What fits: from config shapes alone (no weights loaded), the largest context per batch and
the largest batch per context for each KV scheme under a memory budget."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..engine.memory import row_kv_bytes
from ..policy import KVPolicy, LayerPlan
from ..policy.kv_config import load_kv_config


def plan_from_config(config: dict, policy: KVPolicy) -> list[LayerPlan]:
    """The per-layer plan from config.json alone: sliding layers where the config says so."""
    cfg = config.get("text_config", config)
    n = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window")
    pattern = cfg.get("sliding_window_pattern")
    types = cfg.get("layer_types")
    plans = []
    for i in range(n):
        sliding = bool(window) and (
            (types is not None and types[i] == "sliding_attention")
            or (types is None and pattern and (i + 1) % pattern != 0)
        )
        codec = policy.codec_for(i)
        w = window if sliding else policy.max_kv_size
        plans.append(LayerPlan(i, "window" if w else "full-attention", codec, policy.start, w, 0))
    return plans


def weight_bytes_from_files(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))


def weight_bytes_from_config(config: dict, weight_bits: int | None, dtype_size: int = 2) -> int:
    """Llama-shaped parameter count x bytes per parameter (quantized: bits + 32/64 per weight)."""
    c = config.get("text_config", config)
    h, inter, n, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    heads, kv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    hd = c.get("head_dim") or h // heads
    per_layer = h * hd * (heads * 2 + kv * 2) + 3 * h * inter
    linear = n * per_layer + (0 if c.get("tie_word_embeddings", False) else v * h)
    per_param = dtype_size if not weight_bits else (weight_bits + 32 / 64) / 8
    return int(linear * per_param + v * h * dtype_size + n * 2 * h * dtype_size)


@dataclass(frozen=True)
class FitRow:
    scheme: str
    batch: int | None
    context: int | None
    max_context: int | None = None
    max_batch: int | None = None

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def max_context(config: dict, plans, budget_kv: int, batch: int, dtype_size: int, limit: int) -> int:
    """Largest context (tokens per row, <= limit) whose KV for `batch` rows fits budget_kv."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if batch * row_kv_bytes(config, plans, mid, dtype_size) <= budget_kv:
            lo = mid
        else:
            hi = mid - 1
    return lo


def fit_table(config: dict, policies: dict[str, KVPolicy], budget: int, weights: int, batches, contexts,
              dtype_size: int = 2) -> list[FitRow]:
    free = max(0, budget - weights)
    limit = config.get("text_config", config).get("max_position_embeddings", 131072)
    rows = []
    for name, policy in policies.items():
        plans = plan_from_config(config, policy)
        for b in batches:
            rows.append(FitRow(name, b, None, max_context=max_context(config, plans, free, b, dtype_size, limit)))
        for ctx in contexts:
            per_row = row_kv_bytes(config, plans, ctx, dtype_size)
            rows.append(FitRow(name, None, ctx, max_batch=free // per_row if per_row else None))
    return rows


def policy_with_kv_config(path: str) -> KVPolicy:
    return KVPolicy(layer_codecs=load_kv_config(path), start=0, source="kv_config")
