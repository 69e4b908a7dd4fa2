"""fit's inputs: a budget needs a unit and must hold the weights; GGUF files; shapes listed; the KV
dtype is the one a run stores (checked against a real cache); flags that mean nothing are refused."""

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache
from typer.testing import CliRunner

from kvcore.model_shape import model_shape
from kvcore.models import load_model
from mlxkv_cli.main import build_app

APP = build_app()


def fit(*args):
    return CliRunner().invoke(APP, ["fit", *map(str, args)])


def one_line(r, message):
    assert r.exit_code == 1 and message in r.stderr, r.output
    assert len(r.stderr.strip().splitlines()) == 1 and not r.stdout


@pytest.mark.parametrize("args,message", [
    (["--memory", "24"], "--memory 24: give a unit, e.g. 24GB or 24GiB"),
    (["--memory", "0GB"], "--memory must be more than 0"),
    (["--memory", "1MB"], "--memory 1MB (976.6 KiB) does not hold the weights alone (1015.8 KiB)"),
    (["--memory", "1GB", "--shape", "llama-8b"], "does not hold the weights alone (15.0 GiB)"),
    (["--memory", "24GB", "--shape", "nope"], "unknown shape 'nope' (known: gemma3-12b, gemma3-mini, gemma4-e2b,"),
    (["--memory", "24GB", "--shape", "llama-8b", "-m", "embedded"], "give either -m/--model or --shape"),
    (["--memory", "24GB", "--weight-bits", "4"], "--weight-bits sets the random weights of a --shape"),
    (["--memory", "24GB", "--dtype-bytes", "-2"], "--dtype-bytes must be 1..8"),
    (["--memory", "24GB", "--dtype-bytes", "2", "--dtype", "bf16"], "give --dtype or --dtype-bytes, not both"),
])
def test_fit_refuses_what_it_cannot_answer(args, message):
    one_line(fit(*args), message)


def test_bench_weight_bits_needs_a_shape():
    r = CliRunner().invoke(APP, ["bench", "--weight-bits", "4", "--context", "16"])
    one_line(r, "--weight-bits sets the random weights of a --shape")


def _stored_dtype(lm) -> str:
    cache = [KVCache() for _ in lm.model.layers]
    lm.model(mx.array([[1, 2, 3]]), cache=cache)
    return str(cache[0].keys.dtype).rsplit(".", 1)[-1]


@pytest.mark.parametrize("which", ["folder", "gguf"])
def test_fit_sizes_weights_and_kv_as_a_run_loads_them(which, dense_gguf):
    ref = str(dense_gguf) if which == "gguf" else "embedded"
    shape, lm = model_shape(ref), load_model(ref)
    assert shape.weight_bytes == sum(v.nbytes for _, v in tree_flatten(lm.model.parameters()))
    assert shape.kv_dtype == _stored_dtype(lm) == "float32"  # stories260K is float32: 4-byte KV
    r = fit("-m", ref, "--memory", "64MB", "--json", "--kv", "full", "--batch", "1", "--context", "512")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["weight_bytes"] == shape.weight_bytes and (out["kv_dtype"], out["kv_dtype_bytes"]) == ("float32", 4)
    per_token = 5 * 4 * 8 * 2 * 4  # layers x KV heads x head_dim x (K, V) x 4 bytes
    batch = next(x for x in out["rows"] if x.get("context") == 512)["max_batch"]
    assert batch == (64 * 10**6 - shape.weight_bytes) // (512 * per_token)
    half = json.loads(fit("-m", ref, "--memory", "64MB", "--json", "--kv", "full", "--batch", "1", "--context", "512",
                          "--dtype", "fp16").stdout)
    assert half["kv_dtype_bytes"] == 2 and next(x for x in half["rows"] if x.get("context") == 512)["max_batch"] > batch


def test_fit_table_says_which_kv_dtype():
    r = fit("--memory", "24GB", "--shape", "llama-8b", "--kv", "full", "--batch", "1", "--context", "8192")
    assert r.exit_code == 0 and "bfloat16, 2 bytes" in " ".join(r.stdout.split()), r.output
