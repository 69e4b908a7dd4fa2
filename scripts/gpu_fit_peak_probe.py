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
from mlx_lm import load

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fixtures.tiny_models import build_tiny_model  # noqa: E402

from kvcore.bench.fit import fit_table  # noqa: E402
from kvcore.engine import GenerateConfig, Request  # noqa: E402
from kvcore.engine.generate import generate_one  # noqa: E402
from kvcore.engine.memory import model_bytes  # noqa: E402
from kvcore.policy import KVOptions, build_caches, resolve_policy  # noqa: E402
from kvcore.transient import PrefillMemory  # noqa: E402

SCHEMES = {"full": KVOptions(), "affine4": KVOptions(kv_bits=4, kv_group_size=32, quantized_kv_start=0)}


def case(path: Path, scheme: str, context: int) -> dict:
    model, tok = load(str(path))
    config = json.loads((path / "config.json").read_text())
    policy = resolve_policy(SCHEMES[scheme])
    weights = model_bytes(model)
    row = next(r for r in fit_table(config, {scheme: policy}, 8 << 30, weights, [], [context], dtype_size=4)
               if r.context == context)
    prompt = tuple((7 * i + 3) % (config["vocab_size"] - 4) + 3 for i in range(context - 1))
    mx.synchronize()
    mx.clear_cache()
    live = mx.get_active_memory()
    mx.reset_peak_memory()
    caches = build_caches(model, policy)[0]
    generate_one(model, tok, Request(prompt, 1, "r"), caches,
                 GenerateConfig(prefill_chunk=row.chunk, prefill_memory=PrefillMemory(model, config, policy)))
    mx.synchronize()
    measured = mx.get_peak_memory() - live + weights
    return {"scheme": scheme, "context": context, "chunk": row.chunk, "weights": weights, "predicted": row.peak,
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
