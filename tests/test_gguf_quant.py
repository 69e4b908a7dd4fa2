"""Quantized GGUF files (kvcore.gguf): kept quantized, dequantized, converted, K-quants.

The test file is a Q8_0/Q4_0/Q4_1/F16/F32 mix of stories260K written with
kvcore.gguf.writer (see gguf_helpers); the reference is stories260K carrying the
file's decoded weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest

from gguf_helpers import HF_TO_GGUF, PROMPT, STORIES, greedy, write_quantized
from kvcore.gguf import convert_gguf, load_gguf, read_gguf
from kvcore.gguf import writer as gw


@pytest.fixture(scope="module")
def quant_gguf(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    return write_quantized(tmp_path_factory.mktemp("gguf") / "stories260K-q.gguf")


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
