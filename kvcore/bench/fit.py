"""What fits: from config shapes alone (no weights loaded), the largest context per batch and
the largest batch per context for each KV scheme under a memory budget."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

from ..cache.compressed import TRIM_STEP
from ..codecs import CodecSpec, make_codec
from ..policy import KVPolicy


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


@cache
def _codec(spec: CodecSpec, head_dim: int):
    return make_codec(spec, head_dim)


def layer_bytes(s: LayerShape, key: CodecSpec, value: CodecSpec, tokens: int, dtype_size: int = 2,
                recent: int = 0, keep: int = 0) -> int:
    """Bytes of one row's cache of layer `s` holding `tokens` tokens, as CompressedKVCache stores
    them: the `keep` sink tokens, the `recent` newest and an incomplete codec block stay dense
    (`dtype_size` bytes an element); every complete block before them costs the codecs' own
    bytes_per_token (turbo: packed indices + a float16 norm per vector; affine: packed words +
    float16 scale and bias per group)."""
    kc, vc = _codec(key, s.head_dim), _codec(value, s.head_dim)
    dense = s.kv_heads * s.head_dim * dtype_size  # one of K or V, one token
    if kc is None and vc is None:
        return tokens * 2 * dense
    block = (kc or vc).block_tokens
    encoded = max(0, tokens - min(tokens, keep) - recent) // block * block
    per_token = sum(c.bytes_per_token(s.kv_heads) if c else dense for c in (kc, vc))
    return (tokens - encoded) * 2 * dense + round(encoded * per_token)


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
        total += layer_bytes(s, policy.codec_for(i), policy.value_codec_for(i), t, dtype_size, policy.recent, keep)
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

