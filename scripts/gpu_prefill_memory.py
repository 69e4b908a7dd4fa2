#!/usr/bin/env python3
"""Issue 14's P3 and P8 on the device: prefill peak with the memory model's plan (kvcore.transient)
against weights + KV, and mlx-lm bf16 in the same run. Prints one JSON line per case.

    python scripts/gpu_prefill_memory.py [--shape llama-8b] [--contexts 32768,131072] [--p8]
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx

from kvcore.bench.grid import scheme_policy
from kvcore.bench.shapes import build_random_model
from kvcore.engine import Engine, GenerateConfig, Request
from kvcore.engine.memory import model_bytes
from kvcore.transient import memory_limit, plan_for_model


def traced(runner) -> list:
    """Per prefill chunk of `runner`: (active, peak during the chunk, cache) in bytes after it finished; what a
    chunk leaves held beyond weights + the KV so far shows in `active`, what it needs while it runs in `peak`."""
    rows: list = []
    step = runner.prefill_step

    def wrapped(seq):
        mx.synchronize()
        mx.reset_peak_memory()
        out = step(seq)
        mx.synchronize()
        rows.append((mx.get_active_memory(), mx.get_peak_memory(), mx.get_cache_memory()))
        return out

    runner.prefill_step = wrapped
    return rows


def case(model, cfg, scheme: str, ctx: int, budget: int | None, limit: bool, trace: bool = False) -> dict:
    policy = scheme_policy(scheme)
    plan = plan_for_model(model, cfg, policy, ctx, budget=budget)
    prompt = mx.random.randint(3, min(30000, cfg["vocab_size"]), (ctx,)).tolist()
    engine = Engine(model, None, policy, 1, GenerateConfig(prefill_chunk=plan.chunk), attention=plan.attention,
                    ignore_eos=True)
    chunks = traced(engine.runner) if trace else None
    mx.synchronize()
    mx.clear_cache()
    held = mx.get_active_memory()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    if limit:
        with memory_limit(plan):
            engine.run([Request(tuple(prompt), 1, "p")])
    else:
        engine.run([Request(tuple(prompt), 1, "p")])
    mx.synchronize()
    t = time.perf_counter() - t0
    kv = engine.peak_kv.get("kv_bytes") or plan.kv  # a lone row never joins a batch: the plan's byte model
    w = model_bytes(model)
    out = {"scheme": scheme, "context": ctx, "memory_limit": limit, "budget": budget, "chunk": plan.chunk,
           "prefill_tps": ctx / t, "peak_gb": mx.get_peak_memory() / 1e9, "weights_plus_kv_gb": (w + kv) / 1e9,
           "over": mx.get_peak_memory() / (w + kv) - 1, "planned_peak_gb": plan.peak / 1e9,
           "plan_transient": plan.transient.to_json(), "held_before_gb": held / 1e9, "weights_gb": w / 1e9}
    if chunks:  # per chunk, GB above the weights: held after it, its peak, MLX's buffer cache
        gb = lambda b: round((b - w) / 1e9, 3)
        pick = sorted({0, 1, 2, len(chunks) // 2, len(chunks) - 2, len(chunks) - 1} & set(range(len(chunks))))
        out["chunks"] = {i: [gb(a), gb(p), round(c / 1e9, 3)] for i, (a, p, c) in ((i, chunks[i]) for i in pick)}
        out["chunk_peak_max_gb"] = max(gb(p) for _, p, _ in chunks)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-8b")
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--p8", action="store_true", help="also --weight-bits 4 at 32k and 128k under a 10 GiB budget")
    ap.add_argument("--p8-only", action="store_true", help="only the --weight-bits 4 cases")
    ap.add_argument("--trace", action="store_true", help="memory after each prefill chunk (P8's cases)")
    a = ap.parse_args()
    contexts = [int(c) for c in a.contexts.split(",")]
    if not a.p8_only:
        model, cfg = build_random_model(a.shape)
        for ctx in contexts:
            for limit in (False, True):
                print(json.dumps(case(model, cfg, "affine:4", ctx, None, limit)), flush=True)
        del model
        mx.clear_cache()
    if a.p8 or a.p8_only:
        model, cfg = build_random_model(a.shape, weight_bits=4)
        # 32k first: an excess over the plan that is the same at both lengths is a fixed term (a weight's
        # dequantized copy, logits), one that grows with the context is the KV side's
        for ctx in contexts:
            print(json.dumps(case(model, cfg, "affine:4", ctx, 10 * 2**30, True, a.trace)), flush=True)


if __name__ == "__main__":
    main()
