"""The bench figure (the `plot` extra): decode tok/s, peak memory and KV bytes per KV scheme.

One colour per scheme; mlxkv solid, mlx-lm dashed in the same colour; one marker per batch
size. Several contexts: lines against context, ticked at the measured contexts only. One
context: grouped bars (mlx-lm's hatched). One legend for the figure; a short title.
"""

from __future__ import annotations

import os
from pathlib import Path

PANELS = (("decode_tps", "decode tok/s"), ("peak_memory", "peak memory"), ("kv", "KV cache"))
SIZES = {"peak_memory": ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")), "kv": ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))}
MARKERS = "osD^vP*X"
STYLE = {"mlxkv": "-", "mlx-lm": "--"}


def rows_label(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"


def context_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def short_title(meta: dict) -> str:
    model = str(meta["model"])
    if model.startswith("shape:"):
        name = f"{model[len('shape:'):]} shape"
    else:
        name = Path(model.split(":", 1)[1] if model.startswith("embedded:") else model).name or model
    weights = "" if meta.get("weights") == "trained" else f", {meta.get('weights')} weights"
    return f"{name}{weights} · {meta.get('backend', '')}"


def _bytes(r: dict, key: str):
    if key == "kv":
        return r.get("kv_bytes") or None
    if key == "peak_memory":
        return r["peak_memory_gb"] * 1e9 if r.get("peak_memory_gb") is not None else None
    return r.get(key)


def _unit(rows: list[dict], key: str) -> tuple[float, str]:
    """(divisor, label) for a panel: the largest unit the panel's values reach 1 in."""
    if key not in SIZES:
        return 1.0, ""
    top = max((v for r in rows if (v := _bytes(r, key)) is not None), default=0)
    return next(((d, u) for d, u in SIZES[key] if top >= d), SIZES[key][-1])


def figure(report: dict):
    """A matplotlib Figure of the report (rows with an error are left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import FixedLocator, NullLocator

    rows = [r for r in report["rows"] if "error" not in r]
    schemes = list(dict.fromkeys(r["scheme"] for r in report["rows"]))
    batches = sorted({r["batch"] for r in report["rows"]})
    contexts = sorted({r["context"] for r in report["rows"]})
    engines = [e for e in STYLE if any(r["engine"] == e for r in rows)]
    colour = {s: plt.get_cmap("tab10")(i % 10) for i, s in enumerate(schemes)}
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.8))
    for ax, (key, label) in zip(axes, PANELS):
        scale, unit = _unit(rows, key)
        value = lambda r, key=key, scale=scale: None if _bytes(r, key) is None else _bytes(r, key) / scale  # noqa: E731
        label = f"{label} ({unit})" if unit else label
        if len(contexts) > 1:
            _lines(ax, rows, value, schemes, batches, colour)
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(FixedLocator(contexts))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xticklabels([context_label(c) for c in contexts])
            ax.set_xlabel("context (tokens)")
        else:
            _bars(ax, rows, value, schemes, batches, engines, colour)
            ax.set_xlabel(f"KV scheme, context {context_label(contexts[0])}")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(True, axis="y", alpha=0.3)
    handles = [Patch(color=colour[s], label=s) for s in schemes]
    if len(contexts) > 1:
        handles += [Line2D([], [], color="0.3", linestyle=STYLE[e], label=e) for e in engines]
    else:
        handles += [Patch(facecolor="white", edgecolor="0.3", hatch="//" if e == "mlx-lm" else "", label=e)
                    for e in engines]
    if len(batches) > 1 and len(contexts) > 1:
        handles += [Line2D([], [], color="0.3", marker=MARKERS[i % len(MARKERS)], linestyle="", label=rows_label(b))
                    for i, b in enumerate(batches)]
    elif len(batches) > 1:
        handles.append(Patch(facecolor="none", edgecolor="none", label="xN over a bar: N rows"))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 8), frameon=False, fontsize=8)
    fig.suptitle(short_title(report["meta"]))
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig


def _lines(ax, rows, value, schemes, batches, colour):
    groups: dict = {}
    for r in rows:
        if value(r) is not None:
            groups.setdefault((r["scheme"], r["batch"], r["engine"]), []).append(r)
    for (scheme, batch, engine), rs in sorted(groups.items(), key=lambda kv: (schemes.index(kv[0][0]), kv[0][1:])):
        rs.sort(key=lambda r: r["context"])
        ax.plot([r["context"] for r in rs], [value(r) for r in rs], STYLE[engine], color=colour[scheme],
                marker=MARKERS[batches.index(batch) % len(MARKERS)], markersize=4,
                label=f"{engine} {scheme} x{batch}")


def _bars(ax, rows, value, schemes, batches, engines, colour):
    slots = [(b, e) for b in batches for e in engines]
    width = 0.8 / max(1, len(slots))
    for i, s in enumerate(schemes):
        for j, (b, e) in enumerate(slots):
            r = next((r for r in rows if r["scheme"] == s and r["batch"] == b and r["engine"] == e), None)
            v = value(r) if r else None
            if v is None:
                continue
            ax.bar(i - 0.4 + width * (j + 0.5), v, width, color=colour[s], alpha=0.55 if e == "mlx-lm" else 1.0,
                   hatch="//" if e == "mlx-lm" else "", edgecolor="0.2", linewidth=0.5,
                   label=f"{e} {s} x{b}")
            if len(batches) > 1:
                ax.annotate(f"x{b}", (i - 0.4 + width * (j + 0.5), v), ha="center", va="bottom", fontsize=6,
                            xytext=(0, 1), textcoords="offset points")
    ax.set_xticks(range(len(schemes)))
    ax.set_xticklabels(schemes, rotation=20 if len(schemes) > 3 else 0, fontsize=8)


def write_plot(path: Path, report: dict) -> None:
    import matplotlib.pyplot as plt

    fig = figure(report)
    tmp = Path(path).with_name(f".{Path(path).name}.tmp.png")
    fig.savefig(tmp, dpi=130)
    plt.close(fig)
    os.replace(tmp, path)
