"""Named model shapes with random weights: speed and memory without downloading weights.

The output of anything measured on these must say the weights are random.
"""

from __future__ import annotations

import importlib

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import MlxkvError

_LLAMA = {"model_type": "llama", "rms_norm_eps": 1e-5, "vocab_size": 32000, "rope_theta": 500000.0,
          "tie_word_embeddings": False, "max_position_embeddings": 131072}


def _qwen35(**text) -> dict:
    """A qwen3_5 config: sizes from `text`, the rest as Qwen3.5's (linear attention 3 of 4 layers)."""
    return {"model_type": "qwen3_5", "tie_word_embeddings": True, "text_config": {
        "model_type": "qwen3_5_text", "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10]}, **text}}


SHAPES: dict[str, dict] = {
    "llama-tiny": {**_LLAMA, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024},
    "llama-1b": {**_LLAMA, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64},
    "llama-8b": {**_LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256},
    "qwen3-4b": {"model_type": "qwen3", "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                 "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 131072,
                 "tie_word_embeddings": True},
    "gemma3-12b": {"model_type": "gemma3_text", "hidden_size": 3840, "intermediate_size": 15360,
                   "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
                   "vocab_size": 262208, "sliding_window": 1024, "sliding_window_pattern": 6,
                   "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 131072},
    # Gemma 4 E2B-like: 35 layers, sliding 512 (4 of 5), the last 20 layers reuse earlier K/V
    "gemma4-e2b": {"model_type": "gemma4_text", "hidden_size": 1536, "num_hidden_layers": 35,
                   "intermediate_size": 6144, "num_attention_heads": 8, "num_key_value_heads": 1,
                   "head_dim": 256, "global_head_dim": 512, "num_kv_shared_layers": 20, "sliding_window": 512,
                   "sliding_window_pattern": 5, "vocab_size": 262144, "max_position_embeddings": 131072},
    # CPU-sized models of the same two structures (a CPU cannot hold or run the full-sized ones quickly)
    "gemma4-mini": {"model_type": "gemma4_text", "hidden_size": 512, "num_hidden_layers": 10,
                    "intermediate_size": 2048, "num_attention_heads": 4, "num_key_value_heads": 1,
                    "head_dim": 128, "global_head_dim": 256, "num_kv_shared_layers": 4, "sliding_window": 256,
                    "sliding_window_pattern": 5, "vocab_size": 32000, "vocab_size_per_layer_input": 32000,
                    "hidden_size_per_layer_input": 64, "max_position_embeddings": 131072},
    "gemma3-mini": {"model_type": "gemma3_text", "hidden_size": 256, "intermediate_size": 512,
                    "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
                    "vocab_size": 1024, "sliding_window": 16, "sliding_window_pattern": 6, "rms_norm_eps": 1e-6,
                    "rope_theta": 1000000.0, "max_position_embeddings": 131072},
    "qwen3.5-mini": _qwen35(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                            num_key_value_heads=2, head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8,
                            linear_key_head_dim=64, linear_value_head_dim=64, vocab_size=32000),
    # Qwen3.5-like hybrid: 3 of 4 layers linear attention (fixed-size state), 1 of 4 full attention
    "qwen3.5-4b": _qwen35(hidden_size=2560, intermediate_size=9216, num_hidden_layers=32, num_attention_heads=16,
                          num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                          linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320),
}


def shape_names() -> list[str]:
    return sorted(SHAPES)


def _construct(name: str, weight_bits: int | None, dtype: mx.Dtype) -> tuple[nn.Module, dict]:
    """The model with lazy random weights (nothing computed until evaluated)."""
    if name not in SHAPES:
        raise MlxkvError(f"unknown shape {name!r} (known: {', '.join(shape_names())})")
    if weight_bits not in (None, 4, 8):
        raise MlxkvError(f"--weight-bits must be full, 8 or 4, got {weight_bits}")
    config = dict(SHAPES[name])
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    model.set_dtype(dtype)
    if weight_bits:
        nn.quantize(model, group_size=64, bits=weight_bits)
        config["quantization"] = {"group_size": 64, "bits": weight_bits}
    return model, config


def shape_weight_bytes(name: str, weight_bits: int | None = None, dtype: mx.Dtype = mx.bfloat16) -> int:
    """Exact weight bytes of a shape, from array shapes alone (the lazy weights are never computed)."""
    model, _ = _construct(name, weight_bits, dtype)
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def build_random_model(name: str, weight_bits: int | None = None, dtype: mx.Dtype = mx.bfloat16) -> tuple[nn.Module, dict]:
    """An mlx-lm model of the named shape with random weights (quantized to weight_bits if given)."""
    model, config = _construct(name, weight_bits, dtype)
    mx.eval(model.parameters())
    return model, config
