#!/usr/bin/env python3
"""The SASS instructions a kernel's warps wait on most, from ncu's source page (the `sections-CTX-sass.csv`
scripts/gpu_kernel_sections.sh writes): each with its share of the stall samples and its main reason, and the
load whose result it waits for when that reason is a long scoreboard (a global or local load).

    python3 scripts/ncu_stalls.py sections-4096-sass.csv [--top 12]

Run 14's 4k launch read as `44.1%  FMUL R38, R38, 1.44...  long_sb  <- LDG.E R38` (the 4-byte softmax scale,
a page fault on MLX's scalar pool: BENCHMARKS.md, "Fourteenth and fifteenth H200 runs")."""

from __future__ import annotations

import argparse
import csv
import re
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def read(path: str) -> tuple[list[str], list[list[str]]]:
    rows = list(csv.reader(open(path)))
    at = next((i for i, r in enumerate(rows) if SAMPLES in r), None)
    if at is None:
        raise SystemExit(f"{path}: no '{SAMPLES}' column (not ncu's source page with --print-source sass)")
    return rows[at], [r for r in rows[at + 1:] if len(r) == len(rows[at])]


def producer(data: list[list[str]], src: int, i: int, reg: str) -> str:
    """The nearest earlier load that writes `reg` (what a long-scoreboard wait on it waits for)."""
    for j in range(i - 1, max(-1, i - 400), -1):
        text = data[j][src].strip()
        m = re.match(r"(@!?P\d+\s+)?(LD\S*)\s+([^,]+),", text)
        if m and m.group(3).strip() == reg:
            return f"{text[:60]} (instruction {j})"
    return "?"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    hdr, data = read(a.csv)
    s, src = hdr.index(SAMPLES), hdr.index("Source")
    reasons = [(k, hdr.index(k)) for k in hdr if k.startswith("stall_") and "Not Issued" not in k]
    total = sum(_num(r[s]) for r in data) or 1.0
    by_reason = {k: sum(_num(r[i]) for r in data) for k, i in reasons}
    print(f"{len(data)} instructions, {total:.0f} stall samples; by reason: "
          + ", ".join(f"{k[6:]} {v / total:.0%}" for k, v in sorted(by_reason.items(), key=lambda kv: -kv[1])[:6]))
    for i, r in sorted(enumerate(data), key=lambda x: -_num(x[1][s]))[:a.top]:
        reason = max(reasons, key=lambda kv: _num(r[kv[1]]))[0][6:]
        text = r[src].strip()
        line = f"{_num(r[s]) / total:6.1%}  {i:5d}  {text[:56]:56}  {reason}"
        if reason == "long_sb":  # which load's result: the registers it reads
            regs = re.findall(r"\bR\d+\b", text.split(None, 1)[1] if " " in text else "")
            for reg in regs[1:] or regs:
                p = producer(data, src, i, reg)
                if p != "?":
                    line += f"  <- {p}"
                    break
        print(line)


if __name__ == "__main__":
    sys.exit(main())
