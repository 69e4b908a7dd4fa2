"""HF-style (mlx-lm) config dict from GGUF metadata, for llama-shaped architectures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from kvcore.errors import MlxkvError
from kvcore.gguf.reader import GGUFFile


@dataclass(frozen=True)
class ArchSpec:
    model_type: str  # mlx-lm model module
    hf_arch: str  # HF "architectures" entry
    permute_qk: bool  # llama.cpp stores Q/K rows in interleaved-RoPE order
    attention_bias: bool = False


# GGUF general.architecture -> how to build it with mlx-lm.
# (Mistral / Mixtral-free Llama variants are written as "llama" by llama.cpp.)
ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", "LlamaForCausalLM", permute_qk=True),
    "qwen2": ArchSpec("qwen2", "Qwen2ForCausalLM", permute_qk=False, attention_bias=True),
}


def arch_spec(gguf: GGUFFile) -> tuple[str, ArchSpec]:
    arch = gguf.get("general.architecture")
    if arch is None:
        raise MlxkvError(f"GGUF has no general.architecture: {gguf.path}")
    if arch not in ARCHS:
        raise MlxkvError(
            f"unsupported GGUF architecture '{arch}' (supported: {', '.join(ARCHS)}): "
            f"{gguf.path}")
    return arch, ARCHS[arch]


def _f32(v: Any) -> float:
    """GGUF stores float32: 9.99999974e-06 -> 1e-05."""
    return float(f"{float(v):.7g}")


def _count(gguf: GGUFFile, key: str, default: Any = None) -> int:
    """A positive integer from the metadata (heads, layers, sizes): 0 or a non-integer is refused."""
    v = gguf.get(key, default)
    if v is None:
        raise MlxkvError(f"GGUF metadata is missing '{key}': {gguf.path}")
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise MlxkvError(f"GGUF metadata '{key}' must be a positive integer, got {v!r}: {gguf.path}")
    return v


def build_config(gguf: GGUFFile) -> dict[str, Any]:
    """The config.json mlx-lm expects (no quantization entry; weights.py adds it)."""
    arch, spec = arch_spec(gguf)
    p = arch + "."
    n_heads = _count(gguf, p + "attention.head_count")
    hidden = _count(gguf, p + "embedding_length")
    n_kv = _count(gguf, p + "attention.head_count_kv", n_heads)
    if n_heads % n_kv:
        raise MlxkvError(f"GGUF metadata: {n_heads} attention heads are not a multiple of {n_kv} KV heads: "
                         f"{gguf.path}")
    q_info = gguf.infos.get("blk.0.attn_q.weight")
    head_dim = _count(gguf, p + "attention.key_length",
                      q_info.shape[0] // n_heads if q_info else hidden // n_heads)
    rope_dims = _count(gguf, p + "rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise MlxkvError(f"partial RoPE ({rope_dims} of {head_dim} dims) is not supported: "
                         f"{gguf.path}")
    embd = gguf.infos.get("token_embd.weight")
    tokens = gguf.get("tokenizer.ggml.tokens") or []
    vocab = embd.shape[0] if embd else int(gguf.get(p + "vocab_size", len(tokens)))
    cfg: dict[str, Any] = {
        "architectures": [spec.hf_arch],
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "intermediate_size": _count(gguf, p + "feed_forward_length"),
        "num_hidden_layers": _count(gguf, p + "block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": _count(gguf, p + "context_length", 2048),
        "rms_norm_eps": _f32(gguf.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(gguf.get(p + "rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "attention_bias": spec.attention_bias,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in gguf.infos,
    }
    if gguf.get(p + "expert_count"):
        raise MlxkvError(f"mixture-of-experts GGUF ('{arch}' with experts) is not supported: "
                         f"{gguf.path}")
    rope = _rope_scaling(gguf, p)
    if rope is not None:
        cfg["rope_scaling"] = rope
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"),
                      ("pad_token_id", "padding")):
        tid = gguf.get(f"tokenizer.ggml.{name}_token_id")
        if tid is not None:
            cfg[key] = int(tid)
    return cfg


def _rope_scaling(gguf: GGUFFile, p: str) -> dict[str, Any] | None:
    if "rope_freqs.weight" in gguf.tensors:
        orig = int(gguf.get(p + "rope.scaling.original_context_length", 8192))
        return llama3_rope_scaling(gguf, orig)
    kind = gguf.get(p + "rope.scaling.type", "none")
    factor = gguf.get(p + "rope.scaling.factor")
    if kind in ("none", None) or not factor or float(factor) == 1.0:
        return None
    if kind == "linear":
        return {"type": "linear", "factor": float(factor)}
    raise MlxkvError(f"unsupported RoPE scaling '{kind}': {gguf.path}")


def llama3_rope_scaling(gguf: GGUFFile, orig: int) -> dict[str, Any]:
    """Recover Llama-3 RoPE scaling parameters from llama.cpp's rope_freqs tensor.

    llama.cpp stores per-frequency factors f_i (theta_i / f_i): 1 for short
    wavelengths, `factor` for long ones, 1 / ((1 - s) / factor + s) between, with
    s = (orig / wavelen - low) / (high - low). Only the ratios low:high:orig matter,
    so we fix orig and fit low/high on the in-between frequencies, then check.
    """
    rf = np.array(gguf.tensors["rope_freqs.weight"].astype(mx.float32), np.float64).ravel()
    base = float(gguf.get(gguf.get("general.architecture") + ".rope.freq_base", 10000.0))
    dims = 2 * len(rf)
    wavelen = 2 * np.pi * base ** (np.arange(0, dims, 2) / dims)
    factor = float(rf.max())
    low, high = 1.0, 4.0  # mlx-lm's defaults, used when nothing is scaled
    if factor > 1.0 + 1e-6:
        low, high = _fit_low_high(orig / wavelen, rf, factor)
    cfg = {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(low),
           "high_freq_factor": float(high), "original_max_position_embeddings": orig}
    if not np.allclose(_llama3_factors(cfg, wavelen), rf, rtol=1e-3):
        raise MlxkvError(f"cannot recover Llama-3 RoPE scaling from rope_freqs: {gguf.path}")
    return cfg


def _fit_low_high(x: np.ndarray, rf: np.ndarray, factor: float) -> tuple[float, float]:
    """low/high_freq_factor from x = orig / wavelen and the factors rf (see above)."""
    mid = (rf > 1 + 1e-4) & (rf < factor * (1 - 1e-4))
    s = (1 / rf - 1 / factor) / (1 - 1 / factor)  # smooth in (0, 1) on the mid band
    lo_x = x[rf >= factor * (1 - 1e-4)]  # fully scaled: x <= low
    hi_x = x[rf <= 1 + 1e-4]  # unscaled: x >= high
    if mid.sum() >= 2:
        a, b = np.polyfit(x[mid], s[mid], 1)
        return float(-b / a), float((1 - b) / a)
    lo_edge = lo_x.max() if len(lo_x) else x.min() / 10
    if mid.sum() == 1:  # the line through the one point and a zero between it and lo_edge
        x1, s1 = float(x[mid][0]), float(s[mid][0])
        low = float(np.sqrt(x1 * lo_edge))
        return low, low + (x1 - low) / s1
    hi_edge = hi_x.min() if len(hi_x) else x.max() * 10
    low = float(np.sqrt(lo_edge * hi_edge))
    return low, low * (1 + 1e-3)


def _llama3_factors(cfg: dict[str, Any], wavelen: np.ndarray) -> np.ndarray:
    """Per-frequency multipliers mlx-lm's Llama3RoPE applies (same as llama.cpp's)."""
    factor, low, high = cfg["factor"], cfg["low_freq_factor"], cfg["high_freq_factor"]
    orig = cfg["original_max_position_embeddings"]
    s = (orig / wavelen - low) / (high - low)
    mid = 1 / ((1 - s) / factor + s)
    out = np.where(wavelen > orig / low, factor, 1.0)
    return np.where((wavelen > orig / high) & (wavelen < orig / low), mid, out)
