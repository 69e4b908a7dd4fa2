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
           "decode_tps_max", "vs_mlx_lm", "peak_memory_gb", "kv_bytes", "bits_per_element", "bandwidth_gbs",
           "bandwidth_share", "error")


def ratios(rows: list[dict]) -> list[dict]:
    """Add mlxkv/mlx-lm decode ratios where mlx-lm ran the same case."""
    base = {(r["context"], r["batch"], r["scheme"]): r for r in rows if r["engine"] == "mlx-lm" and "error" not in r}
    full = {(r["context"], r["batch"]): r for r in rows if r["engine"] == "mlx-lm" and r["scheme"] == "full"
            and "error" not in r}
    for r in rows:
        if r["engine"] == "mlxkv" and "error" not in r:
            b = base.get((r["context"], r["batch"], r["scheme"])) or full.get((r["context"], r["batch"]))
            if b:
                r["vs_mlx_lm"] = round(r["decode_tps"] / b["decode_tps"], 3)
    return rows


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def _cells(r: dict) -> list[str]:
    if "error" in r:
        return [str(r["context"]), str(r["batch"]), r["scheme"], r["engine"], f"[red]{escape(r['error'][:90])}[/red]"] + [""] * 6
    spread = f"{_fmt(r['decode_tps'])} ({_fmt(r['decode_tps_min'])}-{_fmt(r['decode_tps_max'])})"
    kv = r.get("kv_bytes")
    share = r.get("bandwidth_share")
    return [str(r["context"]), str(r["batch"]), r["scheme"], r["engine"], _fmt(r.get("prefill_tps")), spread,
            _fmt(r.get("vs_mlx_lm")), _fmt(r.get("peak_memory_gb")), _fmt(kv / 2**20) if kv else "-",
            _fmt(r.get("bits_per_element")), f"{100 * share:.0f}%" if share else "-"]


def render(report: dict, as_json: bool) -> None:
    if as_json:
        json_line(report)
        return
    meta = report["meta"]
    t = Table(title=f"mlxkv bench: {meta['model']} ({meta['weights']} weights), {meta['backend']}, "
                    f"bandwidth: copy {meta['copy_bandwidth_gbs']} GB/s, matrix-vector read {meta['read_bandwidth_gbs']} GB/s")
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    groups: dict = {}
    for r in report["rows"]:
        if "error" not in r:
            groups.setdefault((r["engine"], r["scheme"], r["batch"]), []).append(r)
    for (engine, scheme, batch), rs in sorted(groups.items()):
        rs.sort(key=lambda r: r["context"])
        style = "--" if engine == "mlx-lm" else "-"
        label = f"{engine} {scheme} x{batch}"
        a1.plot([r["context"] for r in rs], [r["decode_tps"] for r in rs], style, marker="o", label=label)
        a2.plot([r["context"] for r in rs], [r["peak_memory_gb"] for r in rs], style, marker="o", label=label)
    a1.set(xlabel="context (tokens)", ylabel="decode tok/s", xscale="log")
    a2.set(xlabel="context (tokens)", ylabel="peak memory (GB)", xscale="log")
    a1.legend(fontsize=7)
    fig.suptitle(f"{report['meta']['model']} ({report['meta']['weights']} weights), {report['meta']['backend']}")
    fig.tight_layout()
    tmp = Path(path).with_name(f".{Path(path).name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
