"""Constrained vs unconstrained batched decoding (issue 18): decode tok/s of the same rows with and
without a JSON-schema mask (llguidance), greedy, every row running to --max-tokens.

    python scripts/bench_constrain.py [-m MODEL] [--rows 8] [--max-tokens 48] [--out benchmarks/constrain-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

from rich.progress import track

from kvcore.backend import backend_name, versions
from kvcore.engine import Engine, GenerateConfig, Request, SamplingConfig
from kvcore.engine.constrain import ConstraintSpec
from kvcore.models import load_model
from kvcore.policy import KVOptions, resolve_policy

SCHEMA = {"type": "object", "required": ["story"], "additionalProperties": False,
          "properties": {"story": {"type": "string", "minLength": 400}}}  # long enough never to end
PROMPTS = ["Once upon a time", "The dog", "She liked to play", "Tom and Lily"]


def run(lm, rows: int, n: int, constraint) -> dict:
    ids = [tuple(lm.tokenizer.encode(PROMPTS[i % len(PROMPTS)])) for i in range(rows)]
    engine = Engine(lm.model, lm.tokenizer, resolve_policy(KVOptions()), rows, GenerateConfig(prefill_chunk=64),
                    interleave=False)
    t0 = time.perf_counter()
    out = engine.run([Request(p, n, str(i), sampling=SamplingConfig(constraint=constraint)) for i, p in enumerate(ids)])
    wall = time.perf_counter() - t0
    return {"decode_tps": round(engine.decoded / engine.decode_time, 1), "wall_s": round(wall, 3),
            "tokens": sum(len(c.token_ids) for c in out), "finish": sorted({c.finish_reason for c in out})}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    lm = load_model(a.model)
    spec = ConstraintSpec("json_schema", json.dumps(SCHEMA))
    run(lm, a.rows, 8, spec), run(lm, a.rows, 8, None)  # warm-up (and the tokenizer's llguidance view)
    res = {"free": [], "constrained": []}
    for _ in track(range(a.repeats), description="constrained vs free", console=None, transient=True):
        res["free"].append(run(lm, a.rows, a.max_tokens, None))
        res["constrained"].append(run(lm, a.rows, a.max_tokens, spec))
    best = {k: max(r["decode_tps"] for r in v) for k, v in res.items()}
    median = {k: statistics.median(r["decode_tps"] for r in v) for k, v in res.items()}  # shared cores: both
    doc = {"model": lm.source, "rows": a.rows, "max_tokens": a.max_tokens, "backend": backend_name(),
           "machine": platform.platform(), "date": time.strftime("%Y-%m-%d"), "versions": versions(), "runs": res,
           "best_decode_tps": best, "ratio": round(best["constrained"] / best["free"], 3),
           "median_decode_tps": median, "median_ratio": round(median["constrained"] / median["free"], 3)}
    print(json.dumps(doc))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
