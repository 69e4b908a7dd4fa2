"""--load-cache of mlx-lm's own prompt caches (written by `mlx_lm.cache_prompt` itself): the same
tokens as mlx-lm's own continuation from that file, a notice saying what is weaker, refusals."""

import json
import sys

import mlx.core as mx
import pytest
from backend_expect import mlx_lm_quantized_runs
from helpers import mlx_lm_greedy
from mlx_lm import load
from mlx_lm.models.cache import load_prompt_cache
from typer.testing import CliRunner

from mlxkv_cli.main import build_app

APP = build_app()
TEXT = " there was a girl"
N = 16


def cache_prompt(monkeypatch, model_dir, out, *args) -> str | None:
    """Run mlx-lm's `cache_prompt` command; its error (first line) or None."""
    from mlx_lm import cache_prompt as cp

    monkeypatch.setattr(sys, "argv", ["cache_prompt", "--model", str(model_dir), "--prompt", "Once upon a time",
                                      "--prompt-cache-file", str(out), *args])
    try:
        cp.main()
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return None


def mlxkv(*args):
    return CliRunner().invoke(APP, ["generate", *map(str, args)])


@pytest.fixture(scope="module")
def qwen3(tiny_models):
    path = tiny_models("qwen3")  # head_dim 64: mlx-lm can quantize its KV
    model, tok = load(str(path))
    return path, model, tok


@pytest.mark.parametrize("kv", [[], ["--kv-bits", "8", "--quantized-kv-start", "0"]], ids=["full", "affine8"])
def test_continues_an_mlx_lm_prompt_cache_as_mlx_lm_does(qwen3, tmp_path, monkeypatch, kv):
    path, model, tok = qwen3
    f = tmp_path / "prompt.safetensors"
    error = cache_prompt(monkeypatch, path, f, *kv)
    if kv and not mlx_lm_quantized_runs(error):  # CUDA: mlx-lm's quantized attention fails (asserted)
        return
    assert error is None
    ids = list(tok.encode(TEXT, add_special_tokens=False))
    theirs, margin = mlx_lm_greedy(model, ids, N, load_prompt_cache(str(f)))
    stop = next((i for i, t in enumerate(theirs) if t in tok.eos_token_ids), len(theirs))
    theirs = theirs[:stop]  # mlxkv stops at EOS
    assert len(theirs) >= 8
    r = mlxkv("-m", path, "--load-cache", f, "-p", TEXT, "-n", N, "--json")
    assert r.exit_code == 0, r.output
    completion, summary = [json.loads(x) for x in r.stdout.splitlines()]
    assert completion["token_ids"] == theirs and margin > 1e-2
    assert "mlx-lm prompt cache" in r.stderr and "holds no token ids" in r.stderr and "weaker" in r.stderr
    assert summary["kv_policy"]["codec"] == ("affine:8/g64" if kv else "full")
    if kv:
        assert summary["bits_per_element"] == 8.5  # the file's packed words, read as mlxkv's affine cache


def test_what_an_mlx_lm_prompt_cache_cannot_do(qwen3, tmp_path, monkeypatch):
    path, _, _ = qwen3
    f = tmp_path / "prompt.safetensors"
    assert cache_prompt(monkeypatch, path, f) is None
    story = tmp_path / "story.txt"
    story.write_text("Once upon a time")
    for args, message in (
        (["-m", path, "--prompt-file", story], "holds no token ids, so a prompt cannot be matched"),
        (["-m", path, "-p", TEXT, "--save-cache", tmp_path / "out.kv"], "an mlx-lm prompt cache holds no token ids"),
        (["-m", path, "-p", ""], "give -p text to continue with"),
        (["-p", TEXT], "the file holds 2 caches; this model has 5"),  # the embedded model
    ):
        r = mlxkv(*args, "--load-cache", f, "-n", "2")
        assert r.exit_code == 1 and message in r.stderr, (args, r.output)
        assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out.kv").exists()
