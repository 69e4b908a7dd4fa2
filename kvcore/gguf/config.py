"""HF-style (mlx-lm) config dict from GGUF metadata, for llama-shaped architectures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


def _req(gguf: GGUFFile, key: str) -> Any:
    v = gguf.get(key)
    if v is None:
        raise MlxkvError(f"GGUF metadata is missing '{key}': {gguf.path}")
    return v


def build_config(gguf: GGUFFile) -> dict[str, Any]:
    """The config.json mlx-lm expects (no quantization entry; weights.py adds it)."""
    arch, spec = arch_spec(gguf)
    p = arch + "."
    n_heads = int(_req(gguf, p + "attention.head_count"))
    hidden = int(_req(gguf, p + "embedding_length"))
    n_kv = int(gguf.get(p + "attention.head_count_kv", n_heads))
    head_dim = int(gguf.get(p + "attention.key_length",
                            gguf.get(p + "rope.dimension_count", hidden // n_heads)))
    tokens = gguf.get("tokenizer.ggml.tokens") or []
    vocab = int(gguf.get(p + "vocab_size", len(tokens)))
    if not vocab and "token_embd.weight" in gguf.infos:
        vocab = gguf.infos["token_embd.weight"].shape[0]
    cfg: dict[str, Any] = {
        "architectures": [spec.hf_arch],
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "intermediate_size": int(_req(gguf, p + "feed_forward_length")),
        "num_hidden_layers": int(_req(gguf, p + "block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": int(gguf.get(p + "context_length", 2048)),
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
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        tid = gguf.get(f"tokenizer.ggml.{name}_token_id")
        if tid is not None:
            cfg[key] = int(tid)
    return cfg


def _rope_scaling(gguf: GGUFFile, p: str) -> dict[str, Any] | None:
    if "rope_freqs.weight" in gguf.infos:
        raise MlxkvError(f"Llama-3 style RoPE frequency factors (rope_freqs) are not supported: "
                         f"{gguf.path}")
    kind = gguf.get(p + "rope.scaling.type", "none")
    factor = gguf.get(p + "rope.scaling.factor")
    if kind in ("none", None) or not factor or float(factor) == 1.0:
        return None
    if kind == "linear":
        return {"type": "linear", "factor": float(factor)}
    raise MlxkvError(f"unsupported RoPE scaling '{kind}': {gguf.path}")
