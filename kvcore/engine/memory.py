"""Admission memory: what a row's KV will cost at its final compressed size, and the budget."""

from __future__ import annotations

import os

import mlx.core as mx

from ..codecs import CodecSpec, make_codec


def _bytes_per_element(spec: CodecSpec, dtype_size: int, head_dim: int) -> float:
    if not spec.compresses:
        return dtype_size
    return make_codec(spec, head_dim).bytes_per_token(1) / head_dim


def row_kv_bytes(config: dict, plans: list, tokens: int, dtype_size: int = 2) -> int:
    """KV bytes of one row holding `tokens` tokens under the per-layer plan."""
    cfg = config.get("text_config", config)
    heads = cfg.get("num_attention_heads", 1)
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg.get("hidden_size", 0) // max(heads, 1)
    total = 0.0
    for p in plans:
        if p.kind == "other":
            continue
        t = min(tokens, p.window) if p.window else tokens
        dense = min(t, p.recent)  # the newest tokens stay full precision
        per_element = sum(_bytes_per_element(s, dtype_size, head_dim) for s in (p.codec, p.values)) / 2
        total += ((t - dense) * per_element + dense * dtype_size) * kv_heads * head_dim * 2
    return int(total)


def default_kv_budget() -> int:
    """The GPU's recommended working set, or half of RAM on CPU."""
    if mx.default_device() != mx.cpu:
        info = mx.device_info()
        if "max_recommended_working_set_size" in info:  # Metal
            return int(info["max_recommended_working_set_size"])
        total = info.get("memory_size") or info.get("total_memory") or 0  # CUDA reports total_memory
        return int(int(total) * 0.8)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2)
