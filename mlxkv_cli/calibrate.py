"""`mlxkv calibrate`: per-layer KV codecs and bits under a budget -> kv_config.json (+ a report)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from kvcore.errors import MlxkvError
from kvcore.store.atomic import atomic_write, check_target
from kvcore.units import parse_bytes

from .hub import fetch_model
from .options import DtypeOpt, ModelOpt, OfflineOpt, TextOpt, WindowsOpt, WindowTokensOpt, reworded
from .progress import counted

CalibrationTextOpt = reworded(TextOpt, "Calibration text file (repeatable).")
CalibrationWindowsOpt = reworded(WindowsOpt, "Windows per calibration text.")
CalibrationWindowTokensOpt = reworded(WindowTokensOpt, "Tokens per calibration window.")


def _kl(v) -> str:
    return "-" if v is None else (f"{v:.2e}" if 0 < abs(v) < 1e-3 else f"{v:.4f}")


def render(report: dict, console: Console) -> None:
    b = report["budget"]
    t = Table(title=f"calibrate: {report['model']} · budget {b['describe']} · chosen: {report['chosen']}")
    for c in ("layer", "choice", "bytes", "predicted KL"):
        t.add_column(c, justify="left" if c == "choice" else "right")
    for r in report["layers"]:
        t.add_row(str(r["layer"]), r["choice"], str(r["bytes"]), _kl(r["predicted_kl"]))
    console.print(t)
    c = Table(title="end-to-end checks (calibration text) and held-out text")
    for col in ("config", "predicted KL", "measured KL", "bits/el", "held-out KL"):
        c.add_column(col, justify="left" if col == "config" else "right")
    held = report["heldout"]
    rows = report["checks"] + ([report["uniform"]] if report["uniform"] else [])
    for r in rows:
        m = r.get("measured", {})
        h = held["chosen"] if r["name"] == report["chosen"] else (
            held["uniform"] if report["uniform"] and r["name"] == report["uniform"]["name"] else None)
        c.add_row(r["name"], _kl(r["predicted_kl"]), _kl(m.get("mean_kl")), f"{m.get('bits_per_element', 0):.2f}",
                  _kl(h["mean_kl"]) if h else "-")
    console.print(c)
    bits = ", ".join(f"{v:.3f} at {k} tokens" for k, v in report["bits_per_element"].items())
    speed = ", ".join(f"{k} {v:.1f}" for k, v in report["decode_tok_s"].items() if v is not None)
    console.print(f"bits/element (metadata and dense tokens at {b['dtype_bytes']} bytes): {bits}")
    console.print(f"decode tok/s (every layer under each choice; chosen = the config): {speed}")
    console.print(f"seconds: {report['seconds']}")


def calibrate(
    text: CalibrationTextOpt,
    output: Annotated[Path, typer.Option("--output", "-o", help="kv_config.json to write (atomic).")],
    model: ModelOpt = None,
    bits: Annotated[Optional[float], typer.Option(help="Budget: bits per element with metadata, at --context tokens (default: --window-tokens).")] = None,
    memory: Annotated[Optional[str], typer.Option(help="Budget: memory for the weights and --batch rows of --context tokens, e.g. 8GB.")] = None,
    context: Annotated[Optional[int], typer.Option(help="Tokens per row the budget is for.")] = None,
    batch: Annotated[int, typer.Option(help="Rows (with --memory).")] = 1,
    kv: Annotated[Optional[str], typer.Option("--kv", help="Candidates: full, CODEC:LO..HI\\[/gG...], /rN, comma-separated. Default: full,affine:2..8,turbo:2..8,/r8,/r16,/r32.")] = None,
    optiq_compatible: Annotated[bool, typer.Option("--optiq-compatible", help="Only what optiq's kv_config expresses: affine, one bits and group per layer, no recent window.")] = False,
    holdout: Annotated[Optional[list[Path]], typer.Option("--holdout", help="Held-out text for the final check (repeatable; default: the sample shipped with mlxkv).")] = None,
    report: Annotated[Optional[Path], typer.Option("--report", help="Write the JSON report here (atomic).")] = None,
    window_tokens: CalibrationWindowTokensOpt = 1024,
    windows: CalibrationWindowsOpt = 1,
    samples: Annotated[int, typer.Option(help="Gradient samples per window (the sensitivity proxy).")] = 4,
    queries: Annotated[int, typer.Option(help="Query positions per window the proxy scores.")] = 256,
    checks: Annotated[int, typer.Option(help="Calibrated configs measured end to end (plus the best uniform scheme).")] = 3,
    sensitivities: Annotated[Optional[Path], typer.Option("--sensitivities", help="Reuse the sensitivities of an earlier --report (same model, texts and proxy settings): solve for another budget without measuring them again.")] = None,
    dtype: DtypeOpt = None,
    dtype_bytes: Annotated[int, typer.Option(help="Bytes per full-precision element and per scale in the budget (2 = bf16/fp16).")] = 2,
    json_out: Annotated[bool, typer.Option("--json", help="The JSON report on stdout instead of the tables.")] = False,
    offline: OfflineOpt = False,
):
    """Choose KV codecs and bits per layer (keys and values apart) under a budget; write a kv_config."""
    from kvcore.calibrate import Budget, CalibrateJob, config_text, run_calibrate
    check_target(output)
    if report is not None:
        check_target(report)
    mem = parse_bytes(memory, "--memory") if memory is not None else None
    if bits is not None and mem is not None:
        raise MlxkvError("give one budget: --bits or --memory, not both")
    budget = Budget(bits, mem, context, batch, dtype_bytes)
    fetch_model(model, offline)
    job = CalibrateJob(tuple(str(t) for t in text), budget, kv, optiq_compatible, model, dtype, window_tokens,
                       windows, tuple(str(h) for h in holdout or ()), samples=samples, queries=queries, checks=checks,
                       sensitivities=None if sensitivities is None else str(sensitivities))
    with counted(Console(stderr=True, highlight=False)) as progress:
        result = run_calibrate(job, progress)
    data = config_text(result.entries).encode()
    atomic_write(output, lambda f: f.write(data))
    if report is not None:
        rep = (json.dumps(result.report, indent=1) + "\n").encode()
        atomic_write(report, lambda f: f.write(rep))
    if json_out:
        print(json.dumps(result.report))
    else:
        render(result.report, Console(highlight=False, width=None if Console().is_terminal else 160))
