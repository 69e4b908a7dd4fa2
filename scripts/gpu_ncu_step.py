#!/usr/bin/env python3
"""A few decode steps of attention layers alone (scripts/gpu_profile_step.py's kinds), for a kernel
profiler: run under `ncu` to get the device time of each kernel a step launches.

    ncu --metrics gpu__time_duration.sum --csv python3 scripts/gpu_ncu_step.py --kind affine4-kernel --context 32768
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_profile_step as g


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", default="affine4-kernel")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=1, help="batch rows of `--context` tokens each (mlxkv kinds)")
    a = ap.parse_args()
    caches = g.build(a.kind, a.context, a.layers, a.rows)
    q = mx.random.normal((a.rows, g.HQ, 1, g.D)).astype(mx.bfloat16)
    for _ in range(a.steps):
        mx.eval(g.step(a.kind, caches, q))
    mx.synchronize()


if __name__ == "__main__":
    main()
