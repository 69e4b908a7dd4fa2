"""`mlxkv fidelity` and its library: the harness tells good schemes from bad ones, counts bytes
honestly, reports mlx-lm's baseline (or why it cannot run), and fails in one line."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from backend_expect import mlx_lm_quantized_runs

from kvcore.errors import MlxkvError
from kvcore.fidelity.run import FidelityJob, run_fidelity
from kvcore.fidelity.schemes import parse_schemes
from mlxkv_cli.main import build_app

CORPUS = Path(__file__).resolve().parents[2] / "shared/assets/corpora/tinystories_val_head.txt"
STORY = ("Once upon a time there was a little girl named Lily. She liked to play with her big red ball in "
         "the park. One day she saw a big dog. The dog was sad because it lost its bone. ") * 12


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    p = tmp_path_factory.mktemp("fid") / "story.txt"
    p.write_text(CORPUS.read_text()[:6000] if CORPUS.is_file() else STORY)
    return str(p)


def rows(report) -> dict:
    return {r["scheme"]: r for r in report.to_json()["rows"]}


@pytest.fixture(scope="module")
def stories(text):
    """The embedded stories260K (head_dim 8), 2 windows of 256 tokens."""
    job = FidelityJob([text], "full,affine:8,turbo:k1v1,turbo:8/r16", windows=2, window_tokens=256, dtype="float32")
    return rows(run_fidelity(job))


def test_full_precision_scheme_has_zero_kl(stories):
    r = stories["full"]
    assert r["mean_kl"] == 0 and r["p99_kl"] == 0 and r["top1_agreement"] == 1.0 and r["ppl_delta"] == 0
    assert r["positions"] == 2 * 255 and r["bits_per_element"] == 16


def test_the_harness_tells_good_from_bad(stories):
    good, bad = stories["affine:8/g64"], stories["turbo:1"]
    assert good["mean_kl"] < 1e-3 and good["top1_agreement"] > 0.97
    assert bad["mean_kl"] > 100 * good["mean_kl"] and bad["mean_kl"] > 0.1 and bad["ppl_delta"] > 0.1
    assert bad["top1_agreement"] < good["top1_agreement"]


def test_bits_per_element_from_nbytes(stories):
    """float32 run: dense elements are 4 bytes in nbytes, 2 in the deployed count."""
    a8, t1, tr = stories["affine:8/g64"], stories["turbo:1"], stories["turbo:8/r16"]
    assert a8["bits_per_element"] == pytest.approx(8.5) and a8["kv_bytes"] == a8["nbytes"]
    assert t1["bits_per_element"] == pytest.approx(1 + 16 / 8) and t1["kv_bytes"] == t1["nbytes"]
    dense = tr["nbytes"] - tr["kv_bytes"]  # 16 recent tokens, 2 extra bytes each element
    assert dense == 16 * tr["kv_elements"] // 256 * 2
    assert tr["bits_per_element"] == pytest.approx(8 * tr["kv_bytes"] / tr["kv_elements"])


def test_mlx_lm_baseline_row_and_its_failure(stories, tiny_models, text):
    # stories260K: head_dim 8 cannot be grouped by 64 along head_dim -> a row that says why
    assert "divisible" in stories["mlx-lm:affine:8/g64"]["error"]
    # a model whose head_dim takes the group: mlx-lm's QuantizedKVCache runs beside ours
    job = FidelityJob([text], "affine:8,mlx-lm:affine:4/g32", model=str(tiny_models("qwen3")), window_tokens=96,
                      chunk=32)
    got = rows(run_fidelity(job))
    assert list(got) == ["affine:8/g64", "mlx-lm:affine:8/g64", "mlx-lm:affine:4/g32"]
    assert got["affine:8/g64"]["error"] is None
    if not mlx_lm_quantized_runs(got["mlx-lm:affine:8/g64"]["error"]):  # CUDA: its documented failure
        assert not mlx_lm_quantized_runs(got["mlx-lm:affine:4/g32"]["error"])
        return
    assert all(r["error"] is None for r in got.values())
    assert got["mlx-lm:affine:8/g64"]["bits_per_element"] == pytest.approx(8.5)
    assert got["mlx-lm:affine:4/g32"]["bits_per_element"] == pytest.approx(5.0)
    ours, theirs = got["affine:8/g64"]["mean_kl"], got["mlx-lm:affine:8/g64"]["mean_kl"]
    assert 0.5 < ours / theirs < 2 and theirs < 0.1 * got["mlx-lm:affine:4/g32"]["mean_kl"]  # random weights


def test_scheme_list_parsing():
    names = [s.name for s in parse_schemes("full, affine:4, affine:4, turbo:k4v3, mlx-lm:affine:4/g32")]
    assert names == ["full", "affine:4/g64", "mlx-lm:affine:4/g64", "turbo:k4v3", "mlx-lm:affine:4/g32"]
    assert [s.name for s in parse_schemes("affine:4/r8", baselines=True)] == ["affine:4/g64/r8"]
    with pytest.raises(MlxkvError, match="mlx-lm baselines are affine"):
        parse_schemes("mlx-lm:turbo:4")


def cli(*args):
    return CliRunner().invoke(build_app(), ["fidelity", *map(str, args)])


def test_cli_json_and_output_file(text, tmp_path):
    out = tmp_path / "fid.json"
    r = cli("--text", text, "--kv", "full,turbo:k4v3", "--window-tokens", "128", "--json", "--output", out)
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report == json.loads(out.read_text())
    assert [x["scheme"] for x in report["rows"]] == ["full", "turbo:k4v3"] and report["windows"] == 1


def test_cli_table(text):
    r = cli("--text", text, "--kv", "affine:4", "--window-tokens", "128", "--no-baselines")
    assert r.exit_code == 0, r.output
    assert "affine:4/g64" in r.stdout and "mlx-lm" not in r.stdout and "mean KL" in r.stdout
    assert "1 window × 128 tokens" in " ".join(r.stdout.split())  # one window, not "1 windows"


@pytest.mark.parametrize("args,message", [
    (["--kv", "lz4:4"], "unknown --kv value 'lz4:4'"),
    (["--kv", "turbo:k4v9"], "turbo bits must be one of"),
    (["--text", "/no/such/file.txt"], "text file not found: /no/such/file.txt"),
    (["--window-tokens", "100000"], "fewer than --window-tokens 100000"),
    (["--chunk", "0"], "--chunk must be >= 1"),
    (["--output", "/no/such/dir/x.json"], "does not exist"),
])
def test_cli_bad_inputs_are_one_line(text, args, message):
    r = cli(*(["--text", text] if "--text" not in args else []), *args)
    assert r.exit_code == 1 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output
