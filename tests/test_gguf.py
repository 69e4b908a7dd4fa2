"""GGUF loading / conversion (kvcore.gguf).

Fast tests build their GGUF files from the embedded stories260K llama (real
weights, SentencePiece vocab): dense with mx.save_gguf, quantized with
kvcore.gguf.writer. Slow tests use the real SmolLM2-135M-Instruct Q4_1 GGUF
(cached by scripts/get-eval-model; skipped when absent).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
import sentencepiece as spm
from mlx_lm.models.cache import make_prompt_cache

from kvcore.errors import MlxkvError
from kvcore.gguf import convert_gguf, load_gguf, read_gguf
from kvcore.gguf import writer as gw

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT / "kvcore/assets/stories260K"
PROMPT = "Once upon a time"
TEXTS = [
    PROMPT,
    "Lily and Ben went to the park. They saw a big dog!",
    "  two  spaces, tabs\tand\nnewlines\n\n",
    "Numbers 12345 and 3.14, punctuation: (a) [b] {c}; 'q' \"dq\"",
    "unicode: café naïve — 東京 🙂",
    "",
]


# --- building a llama GGUF from the stories260K folder ----------------------

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


# --- helpers -------------------------------------------------------------------


def greedy(model: nn.Module, ids: list[int], n: int = 20) -> list[int]:
    cache = make_prompt_cache(model)
    logits = model(mx.array([ids]), cache=cache)
    out = []
    for _ in range(n):
        tok = int(mx.argmax(logits[0, -1]).item())
        out.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)
    return out


@pytest.fixture(scope="module")
def source():
    return mlx_lm.load(str(STORIES))


@pytest.fixture(scope="module")
def dense_gguf(tmp_path_factory) -> Path:
    return write_dense(tmp_path_factory.mktemp("gguf") / "stories260K-f32.gguf")


@pytest.fixture(scope="module")
def quant_gguf(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    return write_quantized(tmp_path_factory.mktemp("gguf") / "stories260K-q.gguf")


# --- dense GGUF ------------------------------------------------------------------


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


# --- quantized GGUF ----------------------------------------------------------


def _reference(decoded: dict[str, np.ndarray]) -> nn.Module:
    """stories260K with the GGUF's decoded weights (back in HF order): the exact target."""
    model, _ = mlx_lm.load(str(STORIES))
    cfg = json.loads((STORIES / "config.json").read_text())
    inv = {v: k for k, v in HF_TO_GGUF.items()}
    weights = []
    for name, w in decoded.items():
        parts = name.split(".")
        if parts[0] == "blk":
            hf = f"model.layers.{parts[1]}.{inv[parts[2]]}.{parts[3]}"
        else:
            hf = f"{inv[parts[0]]}.{parts[1]}"
        heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
        if parts[-2] in heads:  # undo llama.cpp's permutation (inverse of llama_cpp_permute)
            h = heads[parts[-2]]
            w = w.reshape(h, w.shape[0] // h // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        weights.append((hf, mx.array(w)))
    model.load_weights(weights)
    return model


def test_quantized_stays_quantized(quant_gguf):
    path, decoded = quant_gguf
    model, _, cfg = load_gguf(path)
    attn = model.model.layers[0].self_attn
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert isinstance(attn.q_proj, nn.QuantizedLinear) and attn.q_proj.bits == 4
    assert attn.v_proj.bits == 8 and model.model.embed_tokens.bits == 8
    assert isinstance(model.model.layers[0].mlp.down_proj, nn.Linear)
    q = cfg["quantization"]
    assert q["group_size"] == 32 and q["mode"] == "affine"
    ref = _reference(decoded)
    x = mx.array([[1, 403, 407, 261, 378, 10, 300, 47, 99]])
    err = mx.abs(model(x) - ref(x)).max().item()
    assert err < 2e-2  # float16 scales vs float32 decode


def test_dequantized_matches_decoded_weights(quant_gguf, tmp_path):
    path, decoded = quant_gguf
    model, tok, cfg = load_gguf(path, dequantize=True)
    assert "quantization" not in cfg
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == mx.float32
    ref = _reference(decoded)
    ids = tok.encode(PROMPT)
    assert mx.allclose(model(mx.array([ids])), ref(mx.array([ids])), atol=1e-4).item()
    assert greedy(model, ids) == greedy(ref, ids)


def test_quantized_convert_roundtrip(quant_gguf, tmp_path):
    path, _ = quant_gguf
    model, tok, _ = load_gguf(path)
    out = convert_gguf(path, tmp_path / "q")
    assert "quantization" in json.loads((out / "config.json").read_text())
    model2, _ = mlx_lm.load(str(out))
    assert isinstance(model2.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    x = mx.array([tok.encode(PROMPT)])
    assert mx.array_equal(model(x), model2(x)).item()


def test_k_quants_decode_exactly(tmp_path):
    """Q4_K (kept as MLX affine 4-bit) and Q6_K (dense) vs ggml's reference decoders."""
    rng = np.random.default_rng(0)
    nb = 8  # super-blocks of 256 -> a (2, 1024) tensor
    q4 = np.zeros(nb, [("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qs", "u1", 128)])
    q4["d"], q4["dmin"] = rng.uniform(1e-3, 2e-2, nb), rng.uniform(1e-3, 2e-2, nb)
    q4["scales"], q4["qs"] = rng.integers(0, 256, (nb, 12)), rng.integers(0, 256, (nb, 128))
    q6 = np.zeros(nb, [("ql", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16), ("d", "<f2")])
    q6["ql"], q6["qh"] = rng.integers(0, 256, (nb, 128)), rng.integers(0, 256, (nb, 64))
    q6["scales"], q6["d"] = rng.integers(-128, 128, (nb, 16)), rng.uniform(1e-4, 1e-3, nb)
    path = gw.write_gguf(tmp_path / "k.gguf", {}, {
        "a.weight": gw.RawTensor("Q4_K", (2, 1024), q4.tobytes()),
        "b.weight": gw.RawTensor("Q6_K", (2, 1024), q6.tobytes()),
    })
    t = read_gguf(path).tensors
    a = mx.dequantize(t["a.weight"], t["a.scales"], t["a.biases"], group_size=32, bits=4)
    assert np.array_equal(np.array(a).ravel(), _ggml_q4_k(q4))
    assert np.array_equal(np.array(t["b.weight"]).ravel(), _ggml_q6_k(q6))


def _ggml_q4_k(blocks) -> np.ndarray:  # dequantize_row_q4_K, transcribed
    out = []
    for b in blocks:
        d, dmin, s, qs = np.float32(b["d"]), np.float32(b["dmin"]), b["scales"].astype(int), b["qs"]

        def scale_min(j, s=s):
            if j < 4:
                return s[j] & 63, s[j + 4] & 63
            return (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)
        for c in range(4):
            q = qs[32 * c: 32 * c + 32]
            (sc1, m1), (sc2, m2) = scale_min(2 * c), scale_min(2 * c + 1)
            out += list(d * np.float32(sc1) * (q & 0xF) - dmin * np.float32(m1))
            out += list(d * np.float32(sc2) * (q >> 4) - dmin * np.float32(m2))
    return np.array(out, np.float32)


def _ggml_q6_k(blocks) -> np.ndarray:  # dequantize_row_q6_K, transcribed
    out = []
    for b in blocks:
        d = np.float32(b["d"])
        ql, qh, sc = b["ql"].astype(int), b["qh"].astype(int), b["scales"].astype(int)
        y = np.zeros(256, np.float32)
        for n in range(2):
            L, H, S = ql[64 * n:], qh[32 * n:], sc[8 * n:]
            for j in range(32):
                i = j // 16
                q = [((L[j] & 15) | ((H[j] & 3) << 4)) - 32,
                     ((L[j + 32] & 15) | (((H[j] >> 2) & 3) << 4)) - 32,
                     ((L[j] >> 4) | (((H[j] >> 4) & 3) << 4)) - 32,
                     ((L[j + 32] >> 4) | (((H[j] >> 6) & 3) << 4)) - 32]
                for k in range(4):
                    y[128 * n + j + 32 * k] = d * np.float32(S[i + 2 * k]) * q[k]
        out += list(y)
    return np.array(out, np.float32)


# --- bad inputs -----------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(MlxkvError, match="not found"):
        load_gguf(tmp_path / "nope.gguf")


def test_truncated_file(dense_gguf, tmp_path):
    data = dense_gguf.read_bytes()
    half = tmp_path / "half.gguf"
    half.write_bytes(data[: len(data) // 2])
    with pytest.raises(MlxkvError, match="truncated"):
        load_gguf(half)
    head = tmp_path / "head.gguf"
    head.write_bytes(data[:1000])  # cut inside the vocabulary
    with pytest.raises(MlxkvError, match="truncated"):
        load_gguf(head)


@pytest.mark.parametrize("content", [b"", b"hello, not a model\n", bytes(range(256)) * 40])
def test_not_a_gguf(tmp_path, content):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    with pytest.raises(MlxkvError, match="not a GGUF"):
        load_gguf(bad)


def test_random_bytes_with_gguf_magic(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + np.random.default_rng(0).bytes(4096))
    with pytest.raises(MlxkvError, match="GGUF"):
        load_gguf(bad)


def test_unsupported_architecture(tmp_path):
    meta = stories_metadata()
    meta["general.architecture"] = "mamba"
    path = write_dense(tmp_path / "mamba.gguf", meta)
    with pytest.raises(MlxkvError, match="unsupported GGUF architecture 'mamba'"):
        load_gguf(path)


def test_unsupported_tensor_type(tmp_path):
    tensors = dict(stories_tensors())
    raw = np.zeros(64 * 64 // 256 * 176, np.uint8).tobytes()  # Q5_K: 176 bytes / 256 weights
    tensors["blk.0.attn_q.weight"] = gw.RawTensor("Q5_K", (64, 64), raw)
    path = gw.write_gguf(tmp_path / "q5k.gguf", stories_metadata(), tensors)
    msg = r"unsupported tensor type Q5_K for tensor 'blk\.0\.attn_q\.weight'"
    with pytest.raises(MlxkvError, match=msg):
        load_gguf(path)


def test_unsupported_tokenizer(tmp_path):
    meta = stories_metadata()
    meta["tokenizer.ggml.model"] = "bert"
    path = write_dense(tmp_path / "bert.gguf", meta)
    with pytest.raises(MlxkvError, match="tokenizer model 'bert'"):
        load_gguf(path)


def test_bad_dtype(dense_gguf, tmp_path):
    with pytest.raises(MlxkvError, match="dtype"):
        convert_gguf(dense_gguf, tmp_path / "x", dtype="float8")


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


# --- slow: the real SmolLM2-135M-Instruct Q4_1 GGUF ------------------------------

MLXKV_HOME = Path(os.environ.get("MLXKV_HOME", Path.home() / ".cache/mlxkv"))
SMOL = MLXKV_HOME / "models/SmolLM2-135M-Instruct.Q4_1.gguf"
CORPORA = Path(os.environ.get("MLXKV_CORPORA", ROOT.parent / "shared/assets/corpora"))
needs_smol = pytest.mark.skipif(
    not SMOL.is_file(), reason=f"{SMOL} not cached (run scripts/get-eval-model)")


def _run_with_blas(code: str) -> dict:
    """Run python code under scripts/blas-env.sh (OpenBLAS if installed); its last line is JSON."""
    script = f'. "{ROOT}/scripts/blas-env.sh" && exec "$0" -c "$1"'
    cmd = ["bash", "-c", script, sys.executable, code]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1200)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@needs_smol
@pytest.mark.parametrize("dequantize", [True, False])
def test_smollm2_paris(dequantize):
    model, tok, cfg = load_gguf(SMOL, dequantize=dequantize)
    assert cfg["num_hidden_layers"] == 30 and cfg["tie_word_embeddings"]
    assert isinstance(model.model.layers[0].mlp.up_proj, nn.QuantizedLinear) != dequantize
    text = tok.decode(greedy(model, tok.encode("The capital of France is"), 8))
    assert "Paris" in text, text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    # ... [1, 520, 9531, 198] == "<|im_start|>assistant\n"
    assert chat[0] == 1 and chat[-4:] == tok.encode("<|im_start|>assistant\n")


@pytest.mark.slow
@needs_smol
def test_smollm2_perplexity_tinystories():
    corpus = CORPORA / "tinystories_val_head.txt"
    if not corpus.is_file():
        pytest.skip(f"{corpus} missing (set MLXKV_CORPORA)")
    code = f"""
import json, math, mlx.core as mx, mlx.nn as nn
from kvcore.gguf import load_gguf
model, tok, cfg = load_gguf({str(SMOL)!r}, dequantize=True, dtype=mx.float32)
ids = tok.encode(open({str(corpus)!r}, encoding="utf-8").read()[:200_000])
nll, n = 0.0, 0
for w in range(12):  # 512-token windows: BOS + 511 text tokens
    x = mx.array([[cfg["bos_token_id"]] + ids[w * 511:(w + 1) * 511]])
    nll += nn.losses.cross_entropy(model(x[:, :-1]), x[:, 1:], reduction="sum").item()
    n += x.shape[1] - 1
print(json.dumps({{"ppl": math.exp(nll / n), "tokens": n}}))
"""
    res = _run_with_blas(code)
    assert res["tokens"] == 12 * 511
    assert abs(res["ppl"] - 8.05) / 8.05 < 0.02, res
