"""Dense GGUF files (kvcore.gguf): config, tokenizer, logits and conversion vs stories260K.

The GGUF files are built from the embedded stories260K llama (real weights,
SentencePiece vocab) with mx.save_gguf; see gguf_helpers.
"""

from __future__ import annotations

import json
import math

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from gguf_helpers import (
    PROMPT,
    STORIES,
    gguf_name,
    greedy,
    stories_metadata,
    stories_tensors,
    to_mx_metadata,
)
from kvcore.errors import MlxkvError
from kvcore.gguf import convert_gguf, load_gguf
from kvcore.gguf import writer as gw

TEXTS = [
    PROMPT,
    "Lily and Ben went to the park. They saw a big dog!",
    "  two  spaces, tabs\tand\nnewlines\n\n",
    "Numbers 12345 and 3.14, punctuation: (a) [b] {c}; 'q' \"dq\"",
    "unicode: café naïve — 東京 🙂",
    "",
]


@pytest.fixture(scope="module")
def source():
    return mlx_lm.load(str(STORIES))


def test_config_matches_source(dense_gguf):
    _, _, cfg = load_gguf(dense_gguf)
    src = json.loads((STORIES / "config.json").read_text())
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
                "bos_token_id", "eos_token_id"):
        assert cfg[key] == src[key], key
    assert "quantization" not in cfg


def test_tokenizer_matches_source(source, dense_gguf):
    _, src_tok = source
    _, tok, _ = load_gguf(dense_gguf)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == src_tok.encode(text), text
        skip = {"skip_special_tokens": True}
        assert tok.decode(ids, **skip) == src_tok.decode(ids, **skip)
    assert tok.bos_token == "<s>" and tok.eos_token_id == 2
    assert type(tok.detokenizer).__name__ == "SPMStreamingDetokenizer"


def test_greedy_matches_source(source, dense_gguf):
    src_model, src_tok = source
    model, tok, _ = load_gguf(dense_gguf)
    ids = src_tok.encode(PROMPT)
    assert tok.encode(PROMPT) == ids
    x = mx.array([ids])
    assert mx.allclose(model(x), src_model(x), atol=1e-5).item()
    assert greedy(model, ids) == greedy(src_model, ids)


def test_convert_then_mlx_lm_load(source, dense_gguf, tmp_path):
    src_model, src_tok = source
    out = convert_gguf(dense_gguf, tmp_path / "stories-mlx")
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json"} <= names
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # temp dir renamed
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tcfg["bos_token"] == "<s>" and tcfg["eos_token"] == "</s>"
    model, tok = mlx_lm.load(str(out))
    ids = src_tok.encode(PROMPT)
    assert tok.encode(PROMPT) == ids
    assert greedy(model, ids) == greedy(src_model, ids)
    # refuses a non-empty folder; an existing empty one is fine
    with pytest.raises(MlxkvError, match="not an empty folder"):
        convert_gguf(dense_gguf, out)
    (tmp_path / "empty").mkdir()
    assert convert_gguf(dense_gguf, tmp_path / "empty", dtype="float16").is_dir()
    assert json.loads((tmp_path / "empty/config.json").read_text())["model_type"] == "llama"


def test_dtype_cast(dense_gguf):
    model, _, _ = load_gguf(dense_gguf, dtype=mx.bfloat16)
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == mx.bfloat16


@pytest.mark.parametrize("low,high,orig", [(1.0, 100.0, 5000), (1.0, 8.0, 1000), (1.0, 2.0, 2000)])
def test_llama3_rope_freqs(tmp_path, low, high, orig):
    """llama.cpp's rope_freqs tensor -> an equivalent mlx-lm "llama3" rope_scaling."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": low,
               "high_freq_factor": high, "original_max_position_embeddings": orig}
    d, base = 8, 10000.0  # stories260K head_dim / rope_theta: 2 / 1 / 0 mid-band frequencies
    factors = []
    for i in range(0, d, 2):  # convert_hf_to_gguf.py LlamaModel, llama3 branch
        wavelen = 2 * math.pi * base ** (i / d)
        if wavelen < orig / high:
            factors.append(1.0)
        elif wavelen > orig / low:
            factors.append(8.0)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / 8.0 + smooth))
    arrays = {k: mx.array(v) for k, v in stories_tensors().items()}
    arrays["rope_freqs.weight"] = mx.array(np.array(factors, np.float32))
    path = tmp_path / "llama3.gguf"
    mx.save_gguf(str(path), arrays, to_mx_metadata(stories_metadata()))
    model, tok, cfg = load_gguf(path)
    assert cfg["rope_scaling"]["rope_type"] == "llama3"
    ref, _ = mlx_lm.load(str(STORIES), model_config={"rope_scaling": scaling})
    plain, _ = mlx_lm.load(str(STORIES))
    x = mx.array([tok.encode("Once upon a time there was a big dog who liked to run")])
    assert mx.allclose(model(x), ref(x), atol=1e-4).item()
    assert not mx.allclose(model(x), plain(x), atol=1e-4).item()  # the scaling matters here


def test_qwen2_architecture(tmp_path):
    """A qwen2 GGUF: q/k/v biases, no Q/K row permutation (NEOX RoPE in llama.cpp)."""
    from mlx_lm.models import qwen2

    src = json.loads((STORIES / "config.json").read_text())
    meta = {k.replace("llama.", "qwen2.", 1): v for k, v in stories_metadata().items()}
    meta["general.architecture"] = "qwen2"
    rng = np.random.default_rng(0)
    tensors, hf_weights = {}, []
    for hf, w in mx.load(str(STORIES / "model.safetensors")).items():
        w = np.array(w.astype(mx.float32))
        tensors[gguf_name(hf)] = w  # no permutation for qwen2
        hf_weights.append((hf, mx.array(w)))
        if hf.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            b = rng.standard_normal(w.shape[0]).astype(np.float32) * 0.1
            tensors[gguf_name(hf).replace(".weight", ".bias")] = b
            hf_weights.append((hf.replace(".weight", ".bias"), mx.array(b)))
    path = gw.write_gguf(tmp_path / "qwen2.gguf", meta, tensors)
    model, tok, cfg = load_gguf(path)
    assert cfg["model_type"] == "qwen2"
    args = {**src, "model_type": "qwen2"}
    ref = qwen2.Model(qwen2.ModelArgs.from_dict(args))
    ref.load_weights(hf_weights)
    x = mx.array([tok.encode(PROMPT)])
    assert mx.allclose(model(x), ref(x), atol=1e-5).item()


# --- entry points ------------------------------------------------------------------


def test_module_main(dense_gguf, tmp_path, capsys):
    from kvcore.gguf.__main__ import main

    assert main([str(dense_gguf), str(tmp_path / "m"), "--dequantize", "--dtype", "float32"]) == 0
    assert capsys.readouterr().out.strip() == str((tmp_path / "m").resolve())
    assert main([str(tmp_path / "missing.gguf"), str(tmp_path / "n")]) == 1
    assert "not found" in capsys.readouterr().err


def test_cli_convert_model(dense_gguf, tmp_path, capsys):
    from mlxkv_cli.convert_model import convert_model

    convert_model(dense_gguf, tmp_path / "c", dequantize=False, dtype="float32")
    assert "converted" in capsys.readouterr().out
    assert (tmp_path / "c/model.safetensors").is_file()
    with pytest.raises(MlxkvError, match="not found"):
        convert_model(tmp_path / "nope.gguf", tmp_path / "d", dequantize=False, dtype=None)
