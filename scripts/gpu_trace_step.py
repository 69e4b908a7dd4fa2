#!/usr/bin/env python3
"""Steady decode steps of a whole model for a timeline profiler: what the device and the host do
in a step, per cache kind, with the warm-up kept out of the trace.

Each case warms up, then opens a profiler range (cuProfilerStart/Stop, which `nsys profile
--capture-range=cudaProfilerApi --capture-range-end=repeat` and `ncu --profile-from-start off`
honour), runs its steps and closes it. Cases: `model:KIND` (the model called on its caches, as
scripts/gpu_step_anatomy.py does: a pipelined loop, then a synchronous one whose wall is split into
build / async_eval / wait) and `engine:KIND` (mlxkv's Engine decoding one row, as `bench` does).
KIND: mlx-lm, full, affine4 (portable attention), affine4-kernel (the CUDA kernel, forced).

    nsys profile --capture-range=cudaProfilerApi --capture-range-end=repeat -t cuda,osrt -o trace \\
        python3 scripts/gpu_trace_step.py --cases model:mlx-lm,engine:affine4-kernel --context 512
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import io
import json
import pstats
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import fill
from gpu_step_anatomy import caches_for, scheme_of

from kvcore.attention.config import AttentionConfig
from kvcore.bench.grid import scheme_policy
from kvcore.bench.shapes import build_random_model
from kvcore.engine import Engine, GenerateConfig, Request


def _profiler():
    for name in ("libcuda.so.1", "libcuda.so"):
        try:
            lib = ctypes.CDLL(name)
            return lib.cuProfilerStart, lib.cuProfilerStop
        except OSError:
            continue
    return (lambda: 0), (lambda: 0)


START, STOP = _profiler()


def model_case(model, cfg, kind: str, ctx: int, steps: int) -> dict:
    caches = fill(caches_for(model, kind), ctx, cfg["num_key_value_heads"], cfg["head_dim"], mx.bfloat16)
    return {"case": f"model:{kind}", "context": ctx, **batch_loop(model, caches, 1, steps, warm=6, profiled=True)}


def batch_loop(model, caches: list, rows: int, steps: int, warm: int = 1, profiled: bool = False) -> dict:
    """mlx-lm's pipelined loop (gpu_step_anatomy's) over caches of `rows` rows after `warm` steps: ms per step,
    and the synchronous step split into build / encode / wait (`profiled`: inside the profiler range)."""
    def step(tok):
        return mx.argmax(model(tok, cache=caches)[:, -1, :], axis=-1, keepdims=True)

    y = mx.full((rows, 1), 11, mx.int32)
    for _ in range(warm):
        y = step(y)
        mx.eval(y)
    mx.synchronize()
    if profiled:
        START()
    t0 = time.perf_counter()
    y = step(y)
    mx.async_eval(y)
    for _ in range(steps):
        nxt = step(y)
        mx.async_eval(nxt)
        y.tolist()
        y = nxt
    y.tolist()
    piped = (time.perf_counter() - t0) / (steps + 1)
    build = enc = wait = 0.0
    n = max(steps // 2, 1)  # --steps 1 (a profiler's capture): one sync step still timed
    for _ in range(n):
        a = time.perf_counter()
        y = step(y)
        b = time.perf_counter()
        mx.async_eval(y)
        c = time.perf_counter()
        y.tolist()
        d = time.perf_counter()
        build, enc, wait = build + b - a, enc + c - b, wait + d - c
    if profiled:
        STOP()
    return {"piped_ms": piped * 1e3, "sync_build_ms": build / n * 1e3, "sync_encode_ms": enc / n * 1e3,
            "sync_wait_ms": wait / n * 1e3}


def engine_case(model, cfg, kind: str, ctx: int, steps: int, profile: bool, rows: int = 1) -> dict:
    scheme = scheme_of(kind)
    att = AttentionConfig(cuda_kernel=kind.endswith("kernel"), cuda_min_tokens=0)
    engine = Engine(model, None, scheme_policy(scheme), rows, GenerateConfig(prefill_chunk=2048), interleave=False,
                    attention=att, ignore_eos=True)
    filled = [fill(engine.runner.new_caches(), ctx, cfg["num_key_value_heads"], cfg["head_dim"], mx.bfloat16)
              for _ in range(rows)]
    engine.runner.new_caches = filled.pop  # pop: a merged row's own caches are freed (gpu_bench.mlxkv_decode)
    mx.synchronize()
    mx.reset_peak_memory()  # from here: the rows' merge and the steps (the filled caches already held)
    for i in range(rows):
        engine.add_request(Request((11 + i,), 2 * steps + 24, str(i)))
    done, jumps, last = 0, [], mx.get_peak_memory()
    while engine.has_work and done < 10:
        engine.step()
        done += engine.trace[-1][0] == "decode" if engine.trace else 0
        if rows > 1:  # which warm-up step raised the peak (a join's merge, a decode step's buffer growth)
            mx.synchronize()
            if mx.get_peak_memory() - last > 2**28:
                jumps.append((engine.trace[-1][0], len(engine.running),
                              round(mx.get_peak_memory() / 1e9, 2)))
            last = mx.get_peak_memory()
    mx.synchronize()
    warm_peak = mx.get_peak_memory()
    prof = cProfile.Profile() if profile else None
    START()
    if prof:
        prof.enable()
    t0 = time.perf_counter()
    n = 0
    while engine.has_work and n < steps:
        engine.step()
        n += 1
    wall = (time.perf_counter() - t0) / max(n, 1)
    if prof:
        prof.disable()
    STOP()
    out = {"case": f"engine:{kind}", "context": ctx, "rows": rows, "step_ms": wall * 1e3, "steps": n,
           "peak_gb": mx.get_peak_memory() / 1e9, "warm_peak_gb": warm_peak / 1e9,
           "active_gb": mx.get_active_memory() / 1e9}
    if rows > 1:
        out["peak_jumps"] = jumps  # (step kind, running rows, peak GB) where the peak rose by > 256 MiB
        # the model alone on the engine's merged batch caches: what the engine adds to its step
        out["model_on_batch"] = batch_loop(model, engine.runner.caches, rows, steps)
    if prof:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(22)
        print(f"== host profile of engine:{kind} at {ctx}\n" + text.getvalue(), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-8b")
    ap.add_argument("--cases", default="model:mlx-lm,model:affine4-kernel,engine:full,engine:affine4-kernel")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rows", type=int, default=1, help="engine cases: batch rows of `--context` tokens each")
    ap.add_argument("--cprofile", action="store_true", help="cProfile the engine cases (slower steps)")
    a = ap.parse_args()
    model, cfg = build_random_model(a.shape)
    cfg = cfg.get("text_config", cfg)
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    for c in a.cases.split(","):
        where, kind = c.split(":")
        try:
            r = (model_case(model, cfg, kind, a.context, a.steps) if where == "model"
                 else engine_case(model, cfg, kind, a.context, a.steps, a.cprofile, a.rows))
        except Exception as e:  # noqa: BLE001 - a failing case is a result
            r = {"case": c, "error": f"{type(e).__name__}: {str(e)[:200]}"}
        print(json.dumps(r), flush=True)
        mx.clear_cache()


if __name__ == "__main__":
    main()
