#!/usr/bin/env python3
"""Why a scheme's prefill is slow (issue 14: turbo:k4v3 at 0.46x mlx-lm at 128k, affine:4 at 0.99x): each
2 048-token chunk of one prompt timed on its own (evaluated before the next), the same prompt twice in one
process, then the prompt as `gpu_bench.py` times it (the engine, under the memory model's plan). A first pass
that is slower chunk for chunk than the second means work done once per new shape (kernels built as the
past grows); equal passes whose chunks slow down with the past mean the attention over the stored tokens;
an engine pass well below the raw ones means the memory plan (smaller query groups, blockwise attention, or the
memory limit it runs under holding the graph back).
One JSON line per scheme and pass: seconds per chunk, their sum, tokens/s, and one decode step after the
prompt (`decode_s`). The last chunk ends with the prompt's last token on its own, a decode step over the
compressed past: in a first pass it holds the decode kernel's first use (its build and device check), so
the last chunk less `decode_s` is what that costs; in a later process MLX's PTX cache on disk serves the build.

    python3 scripts/gpu_prefill_probe.py [--shape llama-8b] [--context 32768] [--schemes affine:4,turbo:k4v3]
                                         [--passes 2] [--no-engine]
"""

from __future__ import annotations

import argparse
import json
import time

import sys
from pathlib import Path

import mlx.core as mx

from kvcore.backend import CHECKS, checks_since
from kvcore.bench.grid import scheme_policy
from kvcore.bench.shapes import build_random_model
from kvcore.engine.forward import forward, prefill_chunk
from kvcore.policy import build_caches
from kvcore.transient import plan_for_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import prefill_case  # noqa: E402


def chunks(model, policy, tokens: list[int], chunk: int) -> tuple[list[float], float]:
    """(seconds per prefill chunk of `tokens`, seconds of the decode step after them)."""
    caches = build_caches(model, policy)[0]
    out, done = [], 0
    mx.synchronize()
    while done < len(tokens):
        t0 = time.perf_counter()
        done, logits = prefill_chunk(model, tokens, caches, done, chunk)
        mx.eval(logits[:, -1, :], [c.state for c in caches])
        out.append(round(time.perf_counter() - t0, 4))
    t0 = time.perf_counter()
    logits = forward(model, mx.array([[tokens[-1]]]), caches)
    mx.eval(logits, [c.state for c in caches])
    return out, round(time.perf_counter() - t0, 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-8b")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--schemes", default="affine:4,turbo:k4v3")
    ap.add_argument("--passes", type=int, default=2, help="prefills of the same prompt in this process")
    ap.add_argument("--no-engine", action="store_true", help="skip the engine's pass (gpu_bench's prefill)")
    a = ap.parse_args()
    model, cfg = build_random_model(a.shape)
    tokens = mx.random.randint(3, min(30000, cfg["vocab_size"]), (a.context,)).tolist()
    for scheme in a.schemes.split(","):
        policy = scheme_policy(scheme)
        for rep in range(1, a.passes + 1):
            mx.reset_peak_memory()
            seen = len(CHECKS)
            t, decode_s = chunks(model, policy, tokens, a.chunk)
            checks = checks_since(seen)  # kernel builds and checks of this pass
            print(json.dumps({"scheme": scheme, "pass": rep, "context": a.context, "seconds": round(sum(t), 3),
                              "tps": round(a.context / sum(t), 1), "decode_s": decode_s,
                              "peak_gb": round(mx.get_peak_memory() / 1e9, 2),
                              "checks_s": round(sum(c[2] for c in checks), 3), "checks": checks, "chunks_s": t}), flush=True)
            mx.clear_cache()
        if a.no_engine:
            continue
        r = prefill_case(model, cfg, scheme, a.context)
        plan = plan_for_model(model, cfg, policy, a.context)
        print(json.dumps({"scheme": scheme, "pass": "engine", "context": a.context, "seconds": round(r["ttft_s"], 3),
                          "tps": round(r["prefill_tps"], 1), "peak_gb": round(r["peak_memory_gb"], 2),
                          "plan": {"chunk": plan.chunk, "scratch_bytes": plan.attention.scratch_bytes,
                                   "group": plan.transient.group}}), flush=True)
        mx.clear_cache()


if __name__ == "__main__":
    main()
