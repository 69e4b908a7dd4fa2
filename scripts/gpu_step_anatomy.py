#!/usr/bin/env python3
"""Where a whole model's decode step goes: host graph building, host encoding, device time.

For one random-weight shape (default llama-8b) and each cache kind, the model is called directly
on its caches (no engine) and each step is timed three ways:
  build_ms   Python building the step's graph (the model forward and an argmax), no evaluation
  encode_ms  the `mx.async_eval` call itself (MLX encodes kernels on the calling thread)
  step_ms    wall per step of a pipelined loop (step i+1 queued before step i's token is read)
  sync_ms    wall per step when every step is built, evaluated and read before the next
If build + encode is close to step_ms, the step is host-bound and fewer host ops is the fix; if
step_ms is well above it, the device is. Kinds: mlx-lm (KVCache), full (mlxkv's caches),
affine4 (portable attention), affine4-kernel (the CUDA decode kernel, forced), turbo / turbo-kernel (turbo:k4v3).

Also (`--micro`): host microseconds per custom-kernel call and per plain op, to price a launch.

    python scripts/gpu_step_anatomy.py [--shape llama-8b] [--contexts 512,32768] [--steps 24] [--micro]
        [--profile affine4-kernel]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import fill

from kvcore.attention.config import AttentionConfig
from kvcore.bench.grid import scheme_policy
from kvcore.bench.shapes import build_random_model
from kvcore.policy import build_caches

OUT = Path(os.environ.get("OUT", "gpu-out"))


def caches_for(model, kind: str):
    if kind == "mlx-lm":
        return make_prompt_cache(model)
    att = AttentionConfig(cuda_kernel=kind.endswith("kernel"), cuda_min_tokens=0)
    return build_caches(model, scheme_policy(scheme_of(kind)), att)[0]


def scheme_of(kind: str) -> str:
    """The KV scheme a kind names: full, turbo:k4v3 (turbo, turbo-kernel) or affine:4 (affine4, affine4-kernel)."""
    return "full" if kind == "full" else "turbo:k4v3" if kind.startswith("turbo") else "affine:4"


def anatomy(model, cfg, kind: str, ctx: int, steps: int, profile: bool = False) -> dict:
    caches = fill(caches_for(model, kind), ctx, cfg["num_key_value_heads"], cfg["head_dim"], mx.bfloat16)

    def step(tok):
        logits = model(tok, cache=caches)
        return mx.argmax(logits[:, -1, :], axis=-1, keepdims=True)

    y = mx.array([[11]])
    for _ in range(4):
        y = step(y)
        mx.eval(y)
    build = encode = 0.0
    mx.synchronize()
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    y = step(y)
    mx.async_eval(y)
    for _ in range(steps):
        a = time.perf_counter()
        nxt = step(y)
        b = time.perf_counter()
        mx.async_eval(nxt)
        c = time.perf_counter()
        build, encode = build + b - a, encode + c - b
        y.item()
        y = nxt
    y.item()
    wall = (time.perf_counter() - t0) / (steps + 1)
    if prof is not None:
        import io
        import pstats

        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
        print(f"== host profile of {kind} at {ctx} ({steps} steps)\n" + text.getvalue(), flush=True)
    t0 = time.perf_counter()
    for _ in range(steps // 2):
        y = step(y)
        y.item()
    sync = (time.perf_counter() - t0) / (steps // 2)
    return {"kind": kind, "context": ctx, "build_ms": build / steps * 1e3, "encode_ms": encode / steps * 1e3,
            "step_ms": wall * 1e3, "sync_ms": sync * 1e3}


def micro() -> list[dict]:
    """Host cost per call: a plain op, a tiny custom kernel, and the decode kernel's own call."""
    rows = []
    x = mx.zeros((1, 8, 1, 128), dtype=mx.bfloat16)
    mx.eval(x)
    k = mx.fast.cuda_kernel(name="mlxkv_tiny", input_names=["a"], output_names=["o"],
                            source="o[threadIdx.x] = a[threadIdx.x];")
    for name, fn in (("add", lambda a: a + 1),
                     ("custom", lambda a: k(inputs=[a], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                                           output_shapes=[a.shape], output_dtypes=[a.dtype])[0])):
        for n in (200,):
            mx.eval(fn(x))
            t0 = time.perf_counter()
            y = x
            for _ in range(n):
                y = fn(y)
            t1 = time.perf_counter()
            mx.async_eval(y)
            t2 = time.perf_counter()
            mx.eval(y)
            t3 = time.perf_counter()
            rows.append({"op": name, "chain": n, "build_us": (t1 - t0) / n * 1e6, "encode_us": (t2 - t1) / n * 1e6,
                         "wall_us": (t3 - t0) / n * 1e6})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-8b")
    ap.add_argument("--contexts", default="512,32768")
    ap.add_argument("--kinds", default="mlx-lm,full,affine4,affine4-kernel")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--micro", action="store_true")
    ap.add_argument("--profile", default="", help="a kind whose host time is profiled (cProfile, printed)")
    a = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    out = []
    if a.micro:
        out += micro()
        for r in out:
            print(json.dumps(r), flush=True)
    model, cfg = build_random_model(a.shape)
    cfg = cfg.get("text_config", cfg)
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    for ctx in [int(c) for c in a.contexts.split(",")]:
        for kind in a.kinds.split(","):
            try:
                r = anatomy(model, cfg, kind, ctx, a.steps)
                if kind == a.profile:
                    anatomy(model, cfg, kind, ctx, a.steps, profile=True)
            except Exception as e:  # noqa: BLE001 - a failing kind is a result
                r = {"kind": kind, "context": ctx, "error": f"{type(e).__name__}: {str(e)[:160]}"}
            r["env"] = {k: v for k, v in os.environ.items() if k.startswith("MLX_")}
            out.append(r)
            print(json.dumps(r), flush=True)
            mx.clear_cache()
    with open(OUT / "anatomy.jsonl", "a") as f:
        for r in out:
            f.write(json.dumps(r) + "\n")
    print(f"{'kind':16} {'ctx':>7} {'build':>7} {'encode':>7} {'step':>7} {'sync':>7}  (ms)")
    for r in out:
        if "kind" in r:
            print(f"{r['kind']:16} {r['context']:>7} {r.get('build_ms', 0):7.2f} {r.get('encode_ms', 0):7.2f} "
                  f"{r.get('step_ms', 0):7.2f} {r.get('sync_ms', 0):7.2f} {r.get('error', '')}")


if __name__ == "__main__":
    main()
