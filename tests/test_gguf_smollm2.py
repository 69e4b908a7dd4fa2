"""Slow: the real SmolLM2-135M-Instruct Q4_1 GGUF (cached by scripts/get-eval-model; skipped when absent)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.nn as nn
import pytest

from gguf_helpers import ROOT, greedy
from kvcore.gguf import load_gguf

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
