#!/usr/bin/env python3
"""Device time of a decode step by kernel, from an `ncu --csv --metrics gpu__time_duration.sum` capture
of scripts/gpu_trace_step.py (one case a capture): launches and microseconds per step, largest first.

    python3 scripts/ncu_step_summary.py capture.csv --steps 4 [--top 14] [--label "affine:4 kernel"]

`--steps`: the steps inside the profiler range (a `model:` case of gpu_trace_step.py with --steps S runs
1 + S + S // 2 of them, an `engine:` case S).
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import defaultdict

SCALE = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}


def kernel_times(lines: list[str]) -> list[tuple[str, float]]:
    """(kernel name, device us) per profiled launch, in capture order."""
    rows = list(csv.reader(line for line in lines if not line.startswith("==")))
    hdr = next((r for r in rows if "Metric Name" in r and "Kernel Name" in r), None)
    if hdr is None:
        return []
    out = []
    for r in rows:
        if len(r) != len(hdr) or r is hdr:
            continue
        d = dict(zip(hdr, r))
        if d["Metric Name"] != "gpu__time_duration.sum":
            continue
        try:
            out.append((d["Kernel Name"], float(d["Metric Value"].replace(",", "")) * SCALE.get(d.get("Metric Unit", ""), 1.0)))
        except ValueError:
            continue
    return out


def summary(times: list[tuple[str, float]], steps: int, top: int) -> list[str]:
    """Lines: the step's total, then the `top` kernels by time per step (launches and us per step)."""
    by: dict[str, list[float]] = defaultdict(list)
    for name, us in times:
        by[name].append(us)
    total = sum(us for _, us in times) / steps
    lines = [f"{total:9.1f} us per step, {len(times) / steps:.1f} launches"]
    for name, v in sorted(by.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"  {len(v) / steps:7.1f} launches {sum(v) / steps:9.1f} us  {name[:90]}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    times = kernel_times(open(a.csv, errors="replace").read().splitlines())
    if not times:
        print(f"{a.label or a.csv}: no kernels captured")
        sys.exit(0)
    lines = summary(times, a.steps, a.top)
    print(f"## {a.label or a.csv}: {lines[0]}")
    print("\n".join(lines[1:]))


if __name__ == "__main__":
    main()
