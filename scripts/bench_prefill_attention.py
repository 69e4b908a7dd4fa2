#!/usr/bin/env python3
"""Prefill tok/s and peak memory of a long prompt into compressed KV, mlx-lm in the same run.

For each context: mlx-lm's generate_step (its KVCache, prefill_step_size 2048) until the first
token, then mlxkv's chunked prefill (kvcore.engine.forward.prefill) for each --kv scheme with the
chunk and attention budget of kvcore.transient.plan_prefill (the device default, or --budget-gb),
under `memory_limit(plan)`. Per row: tok/s, seconds, peak GB (mx.get_peak_memory), weights + KV,
the plan's predicted peak and its named transient, the attention paths taken. Random weights
(kvcore.bench.shapes), seeded random prompts; an untimed warm-up of every case first.

    . scripts/blas-env.sh && python scripts/bench_prefill_attention.py --shape llama-tiny --dtype float32 \\
        --contexts 4096,16384 --kv affine:4,turbo:k4v3 [--budget-gb 0.2] [--output benchmarks/prefill-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import date

import mlx.core as mx
from mlx_lm.generate import generate_step
from rich.progress import Progress

from kvcore.backend import backend_name, versions
from kvcore.bench.measure import seeded_prompts, weight_bytes
from kvcore.bench.shapes import SHAPES, build_random_model
from kvcore.cache.bytes import KVByteModel
from kvcore.engine.forward import prefill
from kvcore.errors import MlxkvError
from kvcore.policy import build_caches
from kvcore.policy.kv_spec import parse_kv
from kvcore.policy.plan import KVPolicy, plan_layers
from kvcore.transient import memory_limit, plan_prefill

GB = 1e9


def policy_of(text: str, start: int) -> KVPolicy:
    s = parse_kv(text)
    return KVPolicy(codec=s.key, value_codec=s.value, recent=s.recent, start=start)


def run_mlx_lm(model, tokens: list[int]) -> dict:
    mx.synchronize()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    tok, _ = next(generate_step(mx.array(tokens), model, max_tokens=1, prefill_step_size=2048))
    mx.eval(tok)
    dt = time.perf_counter() - t0
    return {"engine": "mlx-lm", "scheme": "full (KVCache)", "prefill_tps": len(tokens) / dt, "seconds": dt,
            "peak_gb": mx.get_peak_memory() / GB}


def run_mlxkv(model, config, tokens: list[int], scheme: str, start: int, budget: int | None, dtype_size: int) -> dict:
    policy = policy_of(scheme, start)
    weights = weight_bytes(model)
    kv = KVByteModel(config, plan_layers(model, policy), dtype_size, chunk=2048).row_bytes(len(tokens))
    plan = plan_prefill(config, policy, len(tokens), weights, kv, budget, dtype_size)
    caches, _ = build_caches(model, policy, plan.attention)
    mx.synchronize()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    with memory_limit(plan):
        logits = prefill(model, tokens, caches, plan.chunk)
        mx.eval(logits.argmax(-1))
    dt = time.perf_counter() - t0
    peak = mx.get_peak_memory()
    stats = caches[0].stats if hasattr(caches[0], "stats") else None
    return {"engine": "mlxkv", "scheme": scheme + (f" start {start}" if start else ""), "prefill_tps": len(tokens) / dt,
            "seconds": dt, "peak_gb": peak / GB, "weights_gb": weights / GB, "kv_gb": sum(c.nbytes for c in caches) / GB,
            "predicted_peak_gb": plan.peak / GB, "chunk": plan.chunk, "scratch_bytes": plan.attention.scratch_bytes,
            "transient": plan.transient.to_json(), "attention": stats.to_json() if stats else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-tiny", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--weight-bits", type=int, default=None)
    ap.add_argument("--contexts", default="4096,16384")
    ap.add_argument("--kv", default="affine:4,turbo:k4v3")
    ap.add_argument("--start", type=int, default=0, help="--quantized-kv-start of the mlxkv schemes")
    ap.add_argument("--budget-gb", type=float, default=None, help="memory budget the plan must fit (default: none)")
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    dtype = getattr(mx, a.dtype)
    model, config = build_random_model(a.shape, a.weight_bits, dtype)
    vocab = config.get("text_config", config)["vocab_size"]
    budget = int(a.budget_gb * GB) if a.budget_gb else None
    contexts = [int(c) for c in a.contexts.split(",")]
    schemes = a.kv.split(",")
    rows = []
    with Progress(transient=True) as bar:
        task = bar.add_task("warm-up", total=len(contexts) * (len(schemes) + 1) + 1)
        warm = seeded_prompts(vocab, 1, 256, seed=1)[0]
        run_mlx_lm(model, warm)
        for s in schemes:
            run_mlxkv(model, config, warm, s, 0, None, dtype.size)
        bar.advance(task)
        for ctx in contexts:
            tokens = seeded_prompts(vocab, 1, ctx)[0]
            bar.update(task, description=f"{ctx}: mlx-lm")
            rows.append({"context": ctx, **run_mlx_lm(model, tokens)})
            bar.advance(task)
            for s in schemes:
                bar.update(task, description=f"{ctx}: mlxkv {s}")
                try:
                    rows.append({"context": ctx, **run_mlxkv(model, config, tokens, s, a.start, budget, dtype.size)})
                except MlxkvError as e:
                    rows.append({"context": ctx, "engine": "mlxkv", "scheme": s, "error": str(e)})
                bar.advance(task)
                print(json.dumps(rows[-1]), flush=True)
    report = {"type": "prefill", "shape": a.shape, "dtype": a.dtype, "weight_bits": a.weight_bits, "budget_gb": a.budget_gb,
              "weights": "random", "backend": backend_name(), "machine": platform.machine(), "date": str(date.today()),
              "versions": versions(), "rows": rows}
    if a.output:
        with open(a.output, "w") as f:
            json.dump(report, f, indent=1)
    for r in rows:
        if "error" in r:
            print(f"{r['context']:>6} {r['engine']:<6} {r['scheme']:<22} error: {r['error']}")
            continue
        extra = f" predicted {r['predicted_peak_gb']:.3f} GB, chunk {r['chunk']}" if r["engine"] == "mlxkv" else ""
        print(f"{r['context']:>6} {r['engine']:<6} {r['scheme']:<22} {r['prefill_tps']:9.0f} tok/s "
              f"{r['seconds']:7.2f} s  peak {r['peak_gb']:.3f} GB{extra}")


if __name__ == "__main__":
    main()
