#!/usr/bin/env python3
"""What fit's one-row peak model misses on this backend (issue 19): for the tiny fixture models of
tests/test_fit_peak.py, the measured prefill peak against fit's prediction at several contexts, so a
constant excess (a backend workspace) reads apart from one that grows with the prompt (a missed
per-token term). One JSON line per case: predicted and measured bytes, their ratio and difference.

    python3 scripts/gpu_fit_peak_probe.py [--contexts 1024,4096,8192]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fixtures.tiny_models import build_tiny_model  # noqa: E402

from test_fit_peak import SCHEMES, measured_peak  # noqa: E402


def case(path: Path, scheme: str, context: int) -> dict:
    measured, row = measured_peak(path, SCHEMES[scheme], scheme, context)
    return {"scheme": scheme, "context": context, "chunk": row.chunk, "predicted": row.peak,
            "measured": measured, "ratio": round(measured / row.peak, 4), "excess": measured - row.peak,
            "device": str(mx.default_device())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1024,4096,8192")
    ap.add_argument("--families", default="qwen3,llama")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp())
    for family in args.families.split(","):
        path = build_tiny_model(family, root / family)
        for scheme in SCHEMES:
            for ctx in (int(c) for c in args.contexts.split(",")):
                print(json.dumps({"family": family, **case(path, scheme, ctx)}), flush=True)


if __name__ == "__main__":
    main()
