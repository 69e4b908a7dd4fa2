"""bench as a user reads it: progress on stderr, which mlx-lm row "x mlx-lm" compares with, the
bandwidth share's meaning and its errors, baselines bounded by time, and the figure."""

import io

import pytest
from backend_expect import mlx_lm_quantized_runs
from mlx_lm import load
from rich.console import Console

from kvcore.backend import backend_name
from kvcore.bench.baseline_time import project_prefill
from kvcore.bench.grid import BenchConfig, run_grid
from mlxkv_cli import bench_output
from mlxkv_cli.progress import Steps


@pytest.fixture(scope="module")
def run(stories_bench):
    """stories260K, full and affine:4 at two contexts: mlx-lm cannot quantize head_dim 8 (conftest)."""
    return stories_bench[:2]


def test_progress_is_a_line_per_case_in_a_pipe(run):
    _, err = run
    lines = [x for x in err.splitlines() if x.startswith("bench ")]
    cases = [f"{e} {s} ctx={c} batch=1" for c in (16, 32) for s in ("full", "affine:4") for e in ("mlxkv", "mlx-lm")]
    assert [x.split(": ", 1)[1].split(" (")[0] for x in lines] == ["memory bandwidth probe", *cases]
    assert lines[1].startswith("bench 2/9: ") and "elapsed, ~" in lines[-1] and "left)" in lines[-1]


def test_progress_is_a_bar_with_the_case_and_eta_on_a_terminal():
    buf = io.StringIO()
    s = Steps(Console(file=buf, force_terminal=True, width=120), 4, "bench")
    s.start("mlxkv affine:4 ctx=512 batch=1")
    s.bar.refresh()
    s.done()
    text = buf.getvalue()
    assert "bench: mlxkv affine:4 ctx=512 batch=1" in text and "ETA" in text and "0/4" in text


def test_x_mlx_lm_names_the_row_it_compares_with(run):
    rep, _ = run
    rows = {(r["context"], r["scheme"], r["engine"]): r for r in rep["rows"]}
    base = rows[(16, "full", "mlx-lm")]
    assert "error" in rows[(16, "affine:4", "mlx-lm")]  # head_dim 8: mlx-lm cannot quantize it
    quant = rows[(16, "affine:4", "mlxkv")]
    assert quant["vs_mlx_lm_scheme"] == "full" and quant["vs_mlx_lm"] == round(quant["decode_tps"] / base["decode_tps"], 3)
    assert rows[(16, "full", "mlxkv")]["vs_mlx_lm_scheme"] == "full"
    with bench_output.out.capture() as captured:
        bench_output.render(rep, False)
    text = " ".join(captured.get().split())
    assert "(vs full)" in text and "as a share of the bandwidth ceiling" in text


def test_a_share_above_the_ceiling_is_flagged_not_printed(run):
    rep, _ = run
    row = dict(next(r for r in rep["rows"] if r["engine"] == "mlxkv"), bandwidth_share=1.1)
    flagged = bench_output.ratios([row])[0]
    assert flagged["bandwidth_error"].startswith("110% of the bandwidth ceiling: a measurement error")
    assert "110%" not in bench_output._cells(dict(row, bandwidth_share=0.5, bandwidth_error=None))[-1]
    assert bench_output._cells(flagged)[-1] == "[red]error: > 100%[/red]"


def test_a_baseline_far_slower_than_mlxkv_is_skipped_for_time_with_its_estimate(tiny_models):
    model, _ = load(str(tiny_models("qwen3")))  # head_dim 64: mlx-lm runs its quantized cache
    cfg = BenchConfig(("full", "affine:4"), (64,), (1, 2), gen=3, repeats=1, prefill_chunk=16,
                      baseline_factor=1e-6, baseline_min_s=0.0)
    rows = {(r["scheme"], r["batch"], r["engine"]): r for r in run_grid(model, 512, cfg)}
    for scheme in ("full", "affine:4"):
        r = rows[(scheme, 1, "mlx-lm")]
        assert r["skipped"] == "time" and r["estimate_s"] > 0 and r["error"].startswith("skipped for time: mlx-lm "
                                                                                        "would take ~")
        assert "error" not in rows[(scheme, 1, "mlxkv")]
    assert "error" not in rows[("full", 2, "mlx-lm")]  # batches (full precision only) are not bounded
    unbounded = run_grid(model, 512, BenchConfig(("affine:4",), (64,), (1,), gen=3, repeats=1))[1]
    assert unbounded["engine"] == "mlx-lm" and not unbounded.get("skipped")
    mlx_lm_quantized_runs(unbounded.get("error"))  # it ran (CUDA: mlx-lm's documented failure)


def test_prefill_projection():
    assert project_prefill([1.0], 16, 65, 16) == 3 * 1.0  # 48 tokens left (the last one is decoded): 3 chunks
    assert project_prefill([1.0, 2.0], 32, 97, 16) == 4 * 2.0 + 1.0 * 4 * 5 / 2  # each chunk 1 s slower
    assert project_prefill([2.0, 1.0], 32, 49, 16) == 1.0 and project_prefill([], 0, 10, 4) == 0.0


def test_the_figure_ticks_the_measured_contexts_and_pairs_engines_by_colour(run):
    pytest.importorskip("matplotlib")
    from mlxkv_cli.bench_plot import figure

    rep, _ = run
    fig = figure(rep)
    decode, memory, kv = fig.axes
    assert list(decode.get_xticks()) == [16, 32] and [t.get_text() for t in decode.get_xticklabels()] == ["16", "32"]
    assert not decode.xaxis.get_minor_ticks() or not any(t.label1.get_text() for t in decode.xaxis.get_minor_ticks())
    lines = {ln.get_label(): ln for ln in decode.get_lines()}
    ours, theirs = lines["mlxkv full x1"], lines["mlx-lm full x1"]
    assert ours.get_color() == theirs.get_color() and ours.get_linestyle() == "-" and theirs.get_linestyle() == "--"
    assert lines["mlxkv affine:4 x1"].get_color() != ours.get_color()
    assert "KV cache" in kv.get_ylabel() and kv.get_lines() and "peak memory" in memory.get_ylabel()
    assert len(fig.legends) == 1 and all(ax.get_legend() is None for ax in fig.axes)
    assert fig._suptitle.get_text() == f"stories260K · {backend_name()}"  # the backend that ran it
    one = figure({**rep, "rows": [r for r in rep["rows"] if r["context"] == 16]})  # one context: bars
    assert one.axes[0].patches and [t.get_text() for t in one.axes[0].get_xticklabels()] == ["full", "affine:4"]
    import matplotlib.pyplot as plt

    plt.close(fig)
    plt.close(one)
