"""Build GGUF files from the embedded stories260K llama for the GGUF tests.

Dense files go through mx.save_gguf, quantized ones through kvcore.gguf.writer;
tensor names and Q/K row order follow llama.cpp's convert_hf_to_gguf.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import sentencepiece as spm
from mlx_lm.models.cache import make_prompt_cache

from kvcore.gguf import writer as gw

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT / "kvcore/assets/stories260K"
PROMPT = "Once upon a time"

HF_TO_GGUF = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    base, suffix = hf.rsplit(".", 1)
    if base.startswith("model.layers."):
        _, _, i, rest = base.split(".", 3)
        return f"blk.{i}.{HF_TO_GGUF[rest]}.{suffix}"
    return f"{HF_TO_GGUF[base]}.{suffix}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: HF rotate-half rows -> interleaved."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def stories_tensors() -> dict[str, np.ndarray]:
    """GGUF-named float32 tensors of stories260K, Q/K rows in llama.cpp order."""
    cfg = json.loads((STORIES / "config.json").read_text())
    out = {}
    for hf, w in mx.load(str(STORIES / "model.safetensors")).items():
        w = np.array(w.astype(mx.float32))
        if hf.endswith("q_proj.weight"):
            w = llama_cpp_permute(w, cfg["num_attention_heads"])
        elif hf.endswith("k_proj.weight"):
            w = llama_cpp_permute(w, cfg["num_key_value_heads"])
        out[gguf_name(hf)] = w
    return out


def stories_metadata() -> dict:
    """Plain-python metadata a llama.cpp llama GGUF of stories260K would carry."""
    cfg = json.loads((STORIES / "config.json").read_text())
    sp = spm.SentencePieceProcessor(model_file=str(STORIES / "tokenizer.model"))
    n = sp.get_piece_size()
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1
             for i in range(n)]
    return {
        "general.architecture": "llama", "general.name": "stories260K",
        "general.file_type": 0, "general.quantization_version": 2,
        "llama.context_length": cfg["max_position_embeddings"],
        "llama.embedding_length": cfg["hidden_size"],
        "llama.block_count": cfg["num_hidden_layers"],
        "llama.feed_forward_length": cfg["intermediate_size"],
        "llama.rope.dimension_count": cfg["head_dim"],
        "llama.attention.head_count": cfg["num_attention_heads"],
        "llama.attention.head_count_kv": cfg["num_key_value_heads"],
        "llama.attention.layer_norm_rms_epsilon": cfg["rms_norm_eps"],
        "llama.rope.freq_base": cfg["rope_theta"],
        "llama.vocab_size": n,
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": sp.bos_id(), "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": True,
    }


def to_mx_metadata(meta: dict) -> dict:
    """mx.save_gguf wants str, list[str] or mx.array values."""
    out = {}
    for k, v in meta.items():
        if isinstance(v, str) or (isinstance(v, list) and v and isinstance(v[0], str)):
            out[k] = v
        elif isinstance(v, bool):
            out[k] = mx.array(v)
        elif isinstance(v, int):
            out[k] = mx.array(v, dtype=mx.uint32)
        elif isinstance(v, float):
            out[k] = mx.array(v, dtype=mx.float32)
        elif isinstance(v[0], float):
            out[k] = mx.array(v, dtype=mx.float32)
        else:
            out[k] = mx.array(v, dtype=mx.int32)
    return out


def write_dense(path: Path, meta: dict | None = None) -> Path:
    arrays = {k: mx.array(v) for k, v in stories_tensors().items()}
    mx.save_gguf(str(path), arrays, to_mx_metadata(meta or stories_metadata()))
    return path


QUANT = {"token_embd": gw.quantize_q8_0, "attn_q": gw.quantize_q4_0, "attn_k": gw.quantize_q4_0,
         "attn_v": gw.quantize_q8_0, "attn_output": gw.quantize_q4_1,
         "ffn_gate": gw.quantize_q4_1, "ffn_up": gw.quantize_q4_0}  # ffn_down: 172 cols -> F16


def write_quantized(path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """A Q8_0/Q4_0/Q4_1/F16/F32 mix; returns the file and its decoded (HF-order) weights."""
    tensors, decoded = {}, {}
    for name, w in stories_tensors().items():
        kind = name.split(".")[-2]
        t = QUANT[kind](w) if kind in QUANT else gw.dense(w, "F16" if kind == "ffn_down" else "F32")
        tensors[name], decoded[name] = t, gw.dequantize(t)
    gw.write_gguf(path, stories_metadata(), tensors)
    return path, decoded


def greedy(model: nn.Module, ids: list[int], n: int = 20) -> list[int]:
    """`n` greedy tokens after `ids`, with mlx-lm's plain cache."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([ids]), cache=cache)
    out = []
    for _ in range(n):
        tok = int(mx.argmax(logits[0, -1]).item())
        out.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)
    return out
