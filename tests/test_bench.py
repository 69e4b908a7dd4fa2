"""bench and fit: values cross-checked, baseline rows present, files written."""

import builtins
import csv
import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load
from typer.testing import CliRunner

from backend_expect import mlx_lm_quantized_runs

from kvcore.bench import SHAPES
from kvcore.bench.fit import fit_table, layer_shapes, prefill_transient, row_bytes
from kvcore.bench.shapes import shape_weight_bytes
from kvcore.bench.grid import scheme_policy
from kvcore.bench.measure import step_weight_bytes
from kvcore.bench.shapes import _construct
from mlxkv_cli.main import build_app

runner = CliRunner()


def test_bench_rows_are_cross_checked(tiny_models, qwen3_bench):
    """qwen3 fixture: head_dim 64, so mlx-lm can quantize one row and codec arithmetic is exact."""
    rep, out = qwen3_bench  # conftest: 6 schemes, batches 1 and 2; full, affine:8 and affine:4 checked here
    every = {(r["scheme"], r["batch"], r["engine"]): r for r in rep["rows"]}
    assert len(every) == 24
    rows = {k: r for k, r in every.items() if k[0] in ("full", "affine:8", "affine:4")}
    layers, kv_heads, head_dim = 2, 2, 64
    model, _ = load(str(tiny_models("qwen3")))  # untied output layer: the token table is only gathered
    untied_step_weights = sum(v.nbytes for _, v in tree_flatten(model.parameters())) - model.model.embed_tokens.weight.nbytes
    for (scheme, batch, engine), r in rows.items():
        if engine == "mlx-lm" and batch > 1 and scheme != "full":
            assert "cannot quantize" in r["error"]  # shown, not hidden
            continue
        if engine == "mlx-lm" and scheme != "full" and not mlx_lm_quantized_runs(r.get("error")):
            continue  # CUDA: mlx-lm's quantized KV fails (asserted), mlxkv's rows still run
        assert "error" not in r, r
        assert r["tokens"] == batch * 4  # what was asked for, EOS or not
        if engine == "mlxkv":
            tokens = 64 + 4 - 1  # the last sampled token is never fed back
            bits = {"full": 32, "affine:8": 8.5, "affine:4": 4.5}[scheme]
            assert r["bits_per_element"] == bits
            assert r["kv_bytes"] == batch * tokens * layers * kv_heads * head_dim * 2 * bits / 8
            assert r["bytes_per_step"] == untied_step_weights + r["kv_bytes"]
    assert rows[("affine:4", 1, "mlxkv")]["vs_mlx_lm"] > 0
    with open(out / "b.csv") as f:
        assert len(list(csv.DictReader(f))) == 24
    assert json.loads((out / "b.json").read_text())["rows"] == rep["rows"]


def test_bench_default_model_shows_mlx_lm_failing(stories_bench):
    rep = stories_bench[0]  # conftest: full and affine:4 at contexts 16 and 32
    for context in (16, 32):
        by = {(r["scheme"], r["engine"]): r for r in rep["rows"] if r["context"] == context}
        assert "divisible by the quantization group" in by[("affine:4", "mlx-lm")]["error"]
        assert "error" not in by[("full", "mlx-lm")] and "error" not in by[("affine:4", "mlxkv")]
    assert rep["meta"]["weights"] == "trained"


def test_bench_plot_needs_matplotlib(monkeypatch, tmp_path):
    real = builtins.__import__

    def no_mpl(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    r = runner.invoke(build_app(), ["bench", "--plot", str(tmp_path / "p.png"), "--context", "16"])
    assert r.exit_code == 1 and "mlxkv[plot]" in r.stderr and not (tmp_path / "p.png").exists()


def test_bench_plot_written(stories_bench):
    pytest.importorskip("matplotlib")
    assert stories_bench[2].read_bytes()[:4] == b"\x89PNG"  # conftest's run, with --plot


@pytest.mark.parametrize("args,message", [
    (["--kv", "zip:3"], "unknown KV scheme"),
    (["--kv", "full,turbo:k4"], "bits must be N or kNvM"),
    (["--kv", ","], "no schemes given"),
    (["--context", "a,b"], "comma-separated integers"),
    (["--shape", "nope"], "unknown shape"),
    (["--batch", "0"], "positive integers"),
])
def test_bench_bad_input(args, message):
    r = runner.invoke(build_app(), ["bench", *args])
    assert r.exit_code == 1 and message in r.stderr


def test_fit_arithmetic_by_hand():
    cfg = SHAPES["llama-8b"]  # 32 layers, 8 KV heads, head_dim 128
    per_token_bf16 = 32 * 8 * 128 * 2 * 2  # K and V, 2 bytes each = 131072
    shapes = layer_shapes(cfg)
    assert row_bytes(shapes, scheme_policy("full"), 1000, 2) == 1000 * per_token_bf16
    assert row_bytes(shapes, scheme_policy("affine:4"), 1000, 2) == 1000 * 32 * 8 * 128 * 2 * 4.5 / 8
    budget, weights = 40 * 2**30, 16 * 2**30
    full = scheme_policy("full")
    rows = fit_table(cfg, {"full": full}, budget, weights, [1, 4], [32768])
    free = budget - weights
    assert rows[0].max_context == min(free // per_token_bf16, 131072)
    assert rows[1].max_context == free // (4 * per_token_bf16)
    assert rows[2].max_batch == free // (32768 * per_token_bf16)
    # one row's peak: weights + its KV + one layer's prefill transient at the chunk the budget allows
    kv = 32768 * per_token_bf16
    transient, chunk = prefill_transient(cfg, full, 32768, weights, kv, budget, 2)
    assert rows[2].peak == weights + kv + transient and rows[2].chunk == chunk and 0 < transient < budget - weights - kv


def test_fit_sliding_layers_cap_at_the_window():
    cfg = SHAPES["gemma3-12b"]
    shapes = layer_shapes(cfg)
    assert sum(s.window == 1024 for s in shapes) == 40 and sum(s.kind == "full-attention" for s in shapes) == 8
    full = scheme_policy("full")
    a, b = row_bytes(shapes, full, 10_000, 2), row_bytes(shapes, full, 20_000, 2)
    assert b - a == 10_000 * 8 * 8 * 256 * 2 * 2  # only the 8 global layers grow


def test_fit_seed_families_count_only_layers_that_own_kv():
    g4 = layer_shapes(SHAPES["gemma4-e2b"])  # 35 layers: the last 20 reuse earlier K/V
    owners = g4[:15]
    assert all(s.kind == "other" for s in g4[15:])
    assert [s.kind for s in owners].count("full-attention") == 3  # layers 4, 9, 14
    assert {s.head_dim for s in owners if s.kind == "full-attention"} == {512}
    q = layer_shapes(SHAPES["qwen3.5-4b"])  # 1 in 4 layers is attention
    assert [s.kind for s in q].count("full-attention") == 8 and len(q) == 32
    assert row_bytes(q, scheme_policy("full"), 100, 2) == 100 * 8 * 4 * 256 * 2 * 2


@pytest.mark.parametrize("name", ["gemma4-e2b", "qwen3.5-4b"])
def test_seed_shapes_build_with_mlx_lm_classes(name, monkeypatch):
    import kvcore.bench.shapes as shapes

    small = json.loads(json.dumps(SHAPES[name]))
    c = small.get("text_config", small)
    c.update(hidden_size=64, intermediate_size=128, num_hidden_layers=8, vocab_size=256)
    if "vocab_size_per_layer_input" in c or name.startswith("gemma4"):
        c.update(vocab_size_per_layer_input=256, hidden_size_per_layer_input=8, num_kv_shared_layers=3,
                 head_dim=16, global_head_dim=32)
    else:
        c.update(head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                 linear_num_value_heads=4, num_attention_heads=4, num_key_value_heads=2)
    monkeypatch.setitem(shapes.SHAPES, name, small)
    model, config = shapes.build_random_model(name, None)
    assert len(model.layers) == 8


def test_fit_cli(tmp_path):
    r = runner.invoke(build_app(), ["fit", "--shape", "llama-8b", "--memory", "24GB", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["budget_bytes"] == 24 * 10**9
    # llama-8b: 8.03e9 parameters at 2 bytes, counted from lazily built arrays
    assert out["weight_bytes"] == shape_weight_bytes("llama-8b") and 16.0e9 < out["weight_bytes"] < 16.1e9
    ctx = {row["scheme"]: row["max_context"] for row in out["rows"] if row.get("batch") == 4}
    assert ctx["affine:4"] > 3 * ctx["full"]
    r = runner.invoke(build_app(), ["fit", "--memory", "lots"])
    assert r.exit_code == 1 and "cannot read 'lots'" in r.stderr


@pytest.mark.parametrize("shape", ["llama-tiny", "qwen3.5-mini", "gemma4-mini"])
def test_step_weight_bytes_skip_gathered_tables(shape):
    """A decode step reads every weight but gather-only embedding tables (the tied one is the output layer)."""
    model, _ = _construct(shape, None, mx.float32)
    total = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    inner = model.language_model.model if shape == "qwen3.5-mini" else model.model
    gathered = {
        "llama-tiny": lambda: inner.embed_tokens.weight.nbytes,  # untied: lm_head is read instead
        "qwen3.5-mini": lambda: 0,  # tied: the token table is the output layer
        "gemma4-mini": lambda: inner.embed_tokens_per_layer.weight.nbytes,  # tied, plus a per-layer table
    }[shape]()
    assert gathered < total and step_weight_bytes(model) == total - gathered
