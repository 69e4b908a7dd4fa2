"""bench/fit rendering: rich tables, JSON, CSV and a matplotlib plot (the `plot` extra)."""

from __future__ import annotations

import csv as csv_mod
import json
import os
import tempfile
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvcore.errors import MlxkvError

from .output import json_line

err = Console(stderr=True, highlight=False, soft_wrap=True)
out = Console(highlight=False, width=None if Console().is_terminal else 160)
COLUMNS = ("context", "batch", "scheme", "engine", "prefill_tps", "ttft_s", "decode_tps", "decode_tps_min",
           "decode_tps_max", "vs_mlx_lm", "vs_mlx_lm_scheme", "peak_memory_gb", "kv_bytes", "bits_per_element",
           "bandwidth_gbs", "bandwidth_share", "bandwidth_error", "estimate_s", "error")


def ratios(rows: list[dict]) -> list[dict]:
    """mlxkv/mlx-lm decode ratios: against mlx-lm's row of the same scheme where it ran, else its
    full-precision row of the case (`vs_mlx_lm_scheme` says which); a bandwidth share above 100%
    of the ceiling is a measurement error, flagged in the row (`bandwidth_error`), not a figure."""
    ran = {(r["context"], r["batch"], r["scheme"]): r for r in rows if r["engine"] == "mlx-lm" and "error" not in r}
    for r in rows:
        if r["engine"] == "mlxkv" and "error" not in r:
            b = ran.get((r["context"], r["batch"], r["scheme"])) or ran.get((r["context"], r["batch"], "full"))
            if b and b["decode_tps"]:
                r["vs_mlx_lm"] = round(r["decode_tps"] / b["decode_tps"], 3)
                r["vs_mlx_lm_scheme"] = b["scheme"]
        share = r.get("bandwidth_share")
        if share is not None and share > 1:
            r["bandwidth_error"] = (f"{100 * share:.0f}% of the bandwidth ceiling: a measurement error (a step "
                                    f"cannot read faster than the device; its time or byte count is off)")
    return rows


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def _vs(r: dict) -> str:
    if r.get("vs_mlx_lm") is None:
        return "-"
    same = r.get("vs_mlx_lm_scheme") == r["scheme"]
    return _fmt(r["vs_mlx_lm"]) + ("" if same else f" (vs {r.get('vs_mlx_lm_scheme')})")


def _share(r: dict) -> str:
    if r.get("bandwidth_error"):
        return "[red]error: > 100%[/red]"  # the measured figure is in bandwidth_error, not shown as a share
    share = r.get("bandwidth_share")
    return f"{100 * share:.0f}%" if share else "-"


def _cells(r: dict) -> list[str]:
    if "error" in r:
        colour = "yellow" if r.get("skipped") else "red"
        return [str(r["context"]), str(r["batch"]), r["scheme"], r["engine"],
                f"[{colour}]{escape(r['error'][:100])}[/{colour}]"] + [""] * 6
    spread = f"{_fmt(r['decode_tps'])} ({_fmt(r['decode_tps_min'])}-{_fmt(r['decode_tps_max'])})"
    kv = r.get("kv_bytes")
    return [str(r["context"]), str(r["batch"]), r["scheme"], r["engine"], _fmt(r.get("prefill_tps")), spread,
            _vs(r), _fmt(r.get("peak_memory_gb")), _fmt(kv / 2**20) if kv else "-",
            _fmt(r.get("bits_per_element")), _share(r)]


def render(report: dict, as_json: bool) -> None:
    if as_json:
        json_line(report)
        return
    meta = report["meta"]
    ceiling = max(meta["copy_bandwidth_gbs"], meta["read_bandwidth_gbs"])
    t = Table(title=f"mlxkv bench: {meta['model']} ({meta['weights']} weights), {meta['backend']}",
              caption=f"x mlx-lm: mlxkv's decode tok/s over mlx-lm's row of the same scheme (or the one named). "
                      f"BW share: bytes a decode step reads (weights + KV) x steps/s, as a share of the bandwidth "
                      f"ceiling {ceiling} GB/s (the larger of copy {meta['copy_bandwidth_gbs']} and matrix-vector "
                      f"read {meta['read_bandwidth_gbs']} GB/s); above 100% is a measurement error.",
              caption_justify="left")
    for c in ("ctx", "rows", "KV", "engine", "prefill tok/s", "decode tok/s (min-max)", "x mlx-lm", "peak GB",
              "KV MiB", "bits/el", "BW share"):
        t.add_column(c)
    for r in report["rows"]:
        t.add_row(*_cells(r))
    out.print(t)


def _atomic(path: Path, write) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent if str(path.parent) else ".", prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", newline="") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_json(path: Path, report: dict) -> None:
    _atomic(path, lambda f: json.dump(report, f, indent=1))


def write_csv(path: Path, rows: list[dict]) -> None:
    def write(f):
        w = csv_mod.DictWriter(f, fieldnames=list(COLUMNS), extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)

    _atomic(path, write)


def require_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MlxkvError("--plot needs matplotlib: pip install 'mlxkv[plot]'")


def write_plot(path: Path, report: dict) -> None:
    require_matplotlib()
    from .bench_plot import write_plot as plot

    plot(path, report)
