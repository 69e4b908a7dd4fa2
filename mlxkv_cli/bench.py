"""`mlxkv bench`: the KV scheme x context x batch grid, mlxkv beside mlx-lm."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvcore.backend import backend_name, versions
from kvcore.bench import build_random_model
from kvcore.bench.bandwidth import memory_bandwidth
from kvcore.errors import MlxkvError
from kvcore.distributed import current, handshake, load_for_run, shard
from kvcore.models import dtype_name, parse_dtype, trained_context
from kvcore.policy.kv_spec import split_kv_list
from kvcore.store.atomic import check_target

from . import bench_output
from .hub import fetch_model
from .options import DtypeOpt, JsonOpt, ModelOpt, OfflineOpt
from .progress import steps


def parse_ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise MlxkvError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise MlxkvError(f"{what} needs positive integers, got {text!r}")
    return values


def context_note(config: dict, contexts: tuple[int, ...], gen: int) -> str | None:
    """What a case past the model's trained context means for a benchmark (None: none is)."""
    limit, longest = trained_context(config), max(contexts) + gen
    if not limit or longest <= limit:
        return None
    return (f"--context {max(contexts)} + --gen {gen} = {longest} tokens run past the model's trained context of "
            f"{limit} tokens (max_position_embeddings): the timings hold, the tokens would be unreliable")


def bench(
    model: ModelOpt = None,
    shape: Annotated[Optional[str], typer.Option(help="Random-weight model of a named shape (llama-8b, qwen3-4b, gemma3-12b, ...).")] = None,
    weight_bits: Annotated[Optional[str], typer.Option(help="With --shape: full, 8 or 4 (default full).")] = None,
    dtype: DtypeOpt = None,
    kv: Annotated[str, typer.Option(help="Comma-separated KV schemes, as generate's --kv takes them "
                                         "(full, affine:4/g32, turbo:k4v3, turbo:4/r16, config:FILE).")] = "full,affine:8,affine:4",
    context: Annotated[str, typer.Option(help="Comma-separated prompt lengths.")] = "512",
    batch: Annotated[str, typer.Option(help="Comma-separated row counts.")] = "1",
    gen: Annotated[int, typer.Option(help="Tokens generated per row.")] = 64,
    repeats: Annotated[int, typer.Option(help="Timed repeats per case (after one warm-up).")] = 3,
    seed: Annotated[int, typer.Option(help="Seed of the random-token prompts.")] = 0,
    no_baseline: Annotated[bool, typer.Option("--no-baseline", help="Skip mlx-lm's rows.")] = False,
    baseline_budget: Annotated[float, typer.Option(help="A one-row mlx-lm run may take this many times mlxkv's run "
                                                        "of the case (at least 30 s); one that would run longer is "
                                                        "stopped and its row says so, with the estimate. 0: no bound.")] = 10.0,
    output: Annotated[Optional[Path], typer.Option(help="Write the JSON report here.")] = None,
    csv: Annotated[Optional[Path], typer.Option(help="Write the rows as CSV here.")] = None,
    plot: Annotated[Optional[Path], typer.Option(help="PNG: decode tok/s and peak memory against context.")] = None,
    offline: OfflineOpt = False,
    json_out: JsonOpt = False,
):
    """Benchmark KV schemes side by side with mlx-lm."""
    from kvcore.bench.grid import BenchConfig, run_grid
    cfg = BenchConfig(tuple(split_kv_list(kv)), parse_ints(context, "--context"),
                      parse_ints(batch, "--batch"), gen, repeats, seed, not no_baseline,
                      baseline_factor=baseline_budget)
    dtype = dtype_name(dtype)
    if weight_bits is not None and not shape:
        raise MlxkvError("--weight-bits sets the random weights of a --shape: give --shape (a model's weights are "
                         "what its folder holds)")
    weight_bits = weight_bits or "full"
    for target in (output, csv, plot):  # a bad output path fails now, not after the whole run
        if target is not None:
            check_target(target)
    if plot is not None:
        bench_output.require_matplotlib()
    if shape and model:
        raise MlxkvError("give either -m/--model or --shape, not both")
    if shape:
        bits = {"full": None, "8": 8, "4": 4}.get(weight_bits)
        if weight_bits not in ("full", "8", "4"):
            raise MlxkvError(f"--weight-bits must be full, 8 or 4, got {weight_bits!r}")
        dist = current()
        net, config = build_random_model(shape, bits, parse_dtype(dtype or "bfloat16"))
        shard(net, dist)
        handshake(dist, True, repr((shape, weight_bits, dtype, cfg)))
        source, weights = f"shape:{shape}", "random"
    else:
        fetch_model(model, offline)
        lm, dist = load_for_run(model, dtype, repr((model, dtype, cfg)))
        net, config, source, weights = lm.model, lm.config, lm.source, "trained"
    vocab = config.get("text_config", config)["vocab_size"]
    note = context_note(config, cfg.contexts, gen)
    if note:
        bench_output.err.print(f"[yellow]note:[/yellow] {note}")
    n_cases = len(cfg.schemes) * len(cfg.contexts) * len(cfg.batches) * (2 if cfg.baseline else 1)
    with steps(bench_output.err, n_cases + 1, "bench") as progress:  # a bar on a terminal, a line a case elsewhere
        progress.start("memory bandwidth probe")
        bw = memory_bandwidth()
        rows = run_grid(net, vocab, cfg, progress.start, bw["ceiling"])
    report = {"meta": {"model": source, "weights": weights, "backend": backend_name(),
                       "copy_bandwidth_gbs": round(bw["copy"] / 1e9, 1),
                       "read_bandwidth_gbs": round(bw["read"] / 1e9, 1), "date": time.strftime("%Y-%m-%d"),
                       "ranks": dist.size,
                       "gen": gen, "repeats": repeats, **versions()},
              "rows": bench_output.ratios(rows)}
    bench_output.render(report, json_out)
    if output:
        bench_output.write_json(output, report)
    if csv:
        bench_output.write_csv(csv, report["rows"])
    if plot:
        bench_output.write_plot(plot, report)
