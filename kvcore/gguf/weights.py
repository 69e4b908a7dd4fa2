"""GGUF tensors -> mlx-lm (HF-named) weights: names, Q/K row order, quantization."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import mlx.core as mx

from kvcore.errors import MlxkvError
from kvcore.gguf.config import arch_spec
from kvcore.gguf.reader import GGUFFile

GROUP_SIZE = 32  # every ggml type mx.load keeps quantized uses blocks of 32

_TOP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)$")
_SUFFIXES = ("weight", "bias", "scales", "biases")


def hf_name(gguf_name: str) -> str | None:
    """'blk.3.attn_q.scales' -> 'model.layers.3.self_attn.q_proj.scales' (None: unknown)."""
    base, _, suffix = gguf_name.rpartition(".")
    if suffix not in _SUFFIXES:
        return None
    if base in _TOP:
        return f"{_TOP[base]}.{suffix}"
    m = _BLK_RE.match(base)
    if m and m.group(2) in _BLOCK:
        return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{suffix}"
    return None


def unpermute_rows(w: mx.array, n_heads: int) -> mx.array:
    """llama.cpp interleaved-RoPE row order -> HF rotate-half order, per head.

    w: (n_heads * head_dim, ...) rows (packed weights, scales and biases alike).
    Per head, llama.cpp rows are pairs (x0, x_half, x1, x_half+1, ...); HF wants
    the first halves then the second halves (even rows, then odd rows).
    """
    rows = w.shape[0]
    hd = rows // n_heads
    # (h, hd/2, 2, ...) -> (h, 2, hd/2, ...)
    return w.reshape(n_heads, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _quant_bits(w: mx.array, scales: mx.array) -> int:
    # w: (rows, in_dims * bits / 32) uint32, scales: (rows, in_dims / group)
    return w.shape[-1] * 32 // (scales.shape[-1] * GROUP_SIZE)


def convert_weights(
    gguf: GGUFFile,
    config: dict[str, Any],
    dtype: mx.Dtype | None = None,
    dequantize: bool = False,
) -> tuple[dict[str, mx.array], dict[str, Any] | None]:
    """Returns (HF-named weights, the config "quantization" entry or None)."""
    _, spec = arch_spec(gguf)
    n_heads = config["num_attention_heads"]
    n_kv = config["num_key_value_heads"]
    dense_dtype = dtype or (mx.float32 if dequantize else None)
    raw: dict[str, mx.array] = {}
    for name, arr in gguf.tensors.items():
        if name == "rope_freqs.weight":
            continue
        hf = hf_name(name)
        if hf is None:
            raise MlxkvError(f"unexpected tensor '{name}' in a {config['model_type']} GGUF: "
                             f"{gguf.path}")
        if spec.permute_qk and (".q_proj." in hf or ".k_proj." in hf):
            arr = unpermute_rows(arr, n_heads if ".q_proj." in hf else n_kv)
        raw[hf] = arr

    out: dict[str, mx.array] = {}
    layer_bits: dict[str, int] = {}
    for hf, arr in raw.items():
        if hf.endswith((".scales", ".biases")):
            continue
        prefix = hf[: -len(".weight")] if hf.endswith(".weight") else None
        scales = raw.get(f"{prefix}.scales") if prefix else None
        if scales is None:  # dense
            if dense_dtype is not None and mx.issubdtype(arr.dtype, mx.floating):
                arr = arr.astype(dense_dtype)
            out[hf] = arr
            continue
        biases = raw[f"{prefix}.biases"]
        bits = _quant_bits(arr, scales)
        if dequantize:  # in float32 (float16 scales would round every weight to f16)
            w = mx.dequantize(arr, scales.astype(mx.float32), biases.astype(mx.float32),
                              group_size=GROUP_SIZE, bits=bits)
            out[hf] = w.astype(dense_dtype)
            continue
        if dtype is not None:
            scales, biases = scales.astype(dtype), biases.astype(dtype)
        out[hf], out[f"{prefix}.scales"], out[f"{prefix}.biases"] = arr, scales, biases
        layer_bits[prefix] = bits
    return out, _quant_entry(layer_bits)


def _quant_entry(layer_bits: dict[str, int]) -> dict[str, Any] | None:
    """{"group_size": 32, "bits": most common, "mode": "affine", <layer>: {...} for others}."""
    if not layer_bits:
        return None
    bits = Counter(layer_bits.values()).most_common(1)[0][0]
    entry: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": bits, "mode": "affine"}
    for prefix, b in sorted(layer_bits.items()):
        if b != bits:
            entry[prefix] = {"group_size": GROUP_SIZE, "bits": b}
    return entry
