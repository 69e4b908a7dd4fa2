"""`mlxkv fidelity`: teacher-forced KL of KV schemes against full precision, with mlx-lm beside."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvcore.model_shape import check_layers
from kvcore.models import read_config
from kvcore.policy.kv_spec import split_kv_list
from kvcore.store.atomic import atomic_write, check_target

from .hub import fetch_model
from .options import DtypeOpt, ModelOpt, OfflineOpt, TextOpt, WindowsOpt, WindowTokensOpt
from .progress import counted

COLUMNS = (("scheme", "scheme"), ("engine", "engine"), ("bits/el", "bits_per_element"), ("mean KL", "mean_kl"),
           ("p99 KL", "p99_kl"), ("top-1", "top1_agreement"), ("ppl", "ppl"), ("Δppl", "ppl_delta"),
           ("KV MiB", "kv_bytes"), ("s", "seconds"))


def _cell(key: str, v) -> str:
    if v is None:
        return "-"
    if key in ("top1_agreement", "ppl_delta"):
        return f"{100 * v:+.1f}%" if key == "ppl_delta" else f"{100 * v:.1f}%"
    if key == "kv_bytes":
        return f"{v / 2**20:.2f}"
    if key in ("mean_kl", "p99_kl"):
        return f"{v:.2e}" if 0 < abs(v) < 1e-3 else f"{v:.4f}"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def render(report: dict, console: Console) -> None:
    w = report["windows"]
    t = Table(title=f"fidelity: {report['model']} · {w} window{'' if w == 1 else 's'} × {report['window_tokens']} tokens · "
                    f"chunk {report['chunk']} · {report['dtype']} · {report['backend']}")
    errors = any(r["error"] is not None for r in report["rows"])
    for title, _ in COLUMNS:
        t.add_column(title, justify="left" if title in ("scheme", "engine") else "right", no_wrap=True)
    if errors:
        t.add_column("error", overflow="fold")
    for r in report["rows"]:
        cells = [_cell(key, r.get(key)) for _, key in COLUMNS]
        if r["error"] is not None:
            cells = cells[:2] + [""] * (len(COLUMNS) - 2)
        t.add_row(*cells, *([f"[red]{escape(r['error'] or '')}[/red]"] if errors else []))
    console.print(t)
    for r in report["rows"]:
        if r.get("note"):
            console.print(f"note: {r['scheme']}: {r['note']}")
    ok = [r for r in report["rows"] if r["error"] is None and "ppl_reference" in r]
    if ok:
        console.print(f"reference perplexity {ok[0]['ppl_reference']:.3f}; KL in nats per token, "
                      f"bits per element with scales/norms/dense tokens at 2 bytes")


def fidelity(
    text: TextOpt = None,
    model: ModelOpt = None,
    kv: Annotated[str, typer.Option("--kv", help="Comma-separated KV schemes (full, affine:8, affine:4/g32, turbo:k4v3, turbo:4/r16, config:FILE, mlx-lm:affine:4).")] = "full,affine:8,affine:4,turbo:k4v3",
    chunk: Annotated[Optional[int], typer.Option(help="Tokens per teacher-forced forward pass. Default: the largest the memory allows (up to 2048).")] = None,
    windows: WindowsOpt = 1,
    window_tokens: WindowTokensOpt = 1024,
    dtype: DtypeOpt = None,
    baselines: Annotated[bool, typer.Option("--baselines/--no-baselines", help="mlx-lm's QuantizedKVCache row beside each affine scheme.")] = True,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the JSON report to this file (atomic).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="The JSON report on stdout instead of the table.")] = False,
    offline: OfflineOpt = False,
):
    """Measure KV schemes against full precision: KL, top-1 agreement, perplexity, bits per element."""
    from kvcore.fidelity.run import FidelityJob, run_fidelity
    if output is not None:
        check_target(output)
    fetch_model(model, offline)
    check_config_schemes(kv, model)
    job = FidelityJob([str(t) for t in text or ()], kv, model, dtype, chunk, windows, window_tokens, baselines)
    with counted(Console(stderr=True, highlight=False)) as progress:
        report = run_fidelity(job, progress).to_json()
    if output is not None:
        data = (json.dumps(report, indent=1) + "\n").encode()
        atomic_write(output, lambda f: f.write(data))
    if json_out:
        print(json.dumps(report))
    else:
        render(report, Console(highlight=False, width=None if Console().is_terminal else 160))


def check_config_schemes(kv: str, model: str | None) -> None:
    """config:FILE schemes against the model's layers before anything runs (a layer the model
    lacks was an error in that scheme's table cell, and the command exited 0)."""
    from kvcore.bench.grid import scheme_policy
    configs = [s for s in split_kv_list(kv) if s.startswith("config:")]
    config = read_config(model) if configs else None  # None for a GGUF: its load checks the layers
    for s in configs if config else ():
        check_layers(config, scheme_policy(s))
