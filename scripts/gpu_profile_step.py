#!/usr/bin/env python3
"""Where a decode step's time goes: 32 attention layers alone (no weights), per cache kind.

For each kind and context: host time to build one step's graph (no evaluation), and wall
time per step with evaluation pipelined as a decode loop does (async_eval of step i+1 before
reading step i). Kinds: mlx-lm's KVCache + its SDPA; mlxkv's caches (update only; update +
portable attention; update + CUDA kernel). Prints a table; JSON lines to $OUT/profile.jsonl.

    python scripts/gpu_profile_step.py [--contexts 512,32768] [--layers 32] [--steps 64]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention as mlx_lm_sdpa
from mlx_lm.models.cache import KVCache

from kvcore.attention.config import AttentionConfig
from kvcore.attention.hook import _sdpa
from kvcore.cache import BatchCompressedKVCache, CompressedKVCache
from kvcore.codecs import CodecSpec

HQ, HKV, D = 32, 8, 128


def _cache(kind: str):
    if kind.startswith("mlx-lm"):
        return KVCache()
    bits = int(kind[6]) if kind.startswith("affine") and kind[6:7].isdigit() else 4  # affine3-kernel: 3 bits
    spec = CodecSpec("full") if kind.startswith("full") else CodecSpec("affine", bits, 64)
    vspec = None
    if kind.startswith("turbo"):  # turbo:k4v3
        spec, vspec = CodecSpec("turbo", 4), CodecSpec("turbo", 3)
    kernel = kind.endswith("kernel")  # forced at every context (the default serves from cuda_min_tokens)
    return CompressedKVCache(spec, vspec, start=0, attention=AttentionConfig(cuda_kernel=kernel, cuda_min_tokens=0))


def _filled(c, ctx: int):
    for lo in range(0, ctx, 8192):
        n = min(8192, ctx - lo)
        c.update_and_fetch(mx.random.normal((1, HKV, n, D)).astype(mx.bfloat16),
                           mx.random.normal((1, HKV, n, D)).astype(mx.bfloat16))
    mx.eval([a for a in (c.state if isinstance(c.state, tuple) else [c.state]) if isinstance(a, mx.array)])
    return c


def build(kind: str, ctx: int, layers: int, rows: int = 1):
    """`layers` caches of `ctx` tokens; with `rows` > 1, mlxkv's batch caches of that many rows (packed on CUDA,
    as the engine merges them)."""
    caches = []
    for _ in range(layers):
        if rows == 1:
            caches.append(_filled(_cache(kind), ctx))
            continue
        batch = BatchCompressedKVCache([_filled(_cache(kind), ctx) for _ in range(rows)])
        batch._maybe_pack()
        mx.eval(batch.state)
        caches.append(batch)
    return caches


def step(kind: str, caches, q):
    x = q
    for c in caches:
        k = x[:, :HKV].astype(mx.bfloat16)
        if kind.endswith("update"):
            view, _ = c.update_and_fetch(k, k)
            x = x + 1e-3 * (view.segments[0].parts()[0][0].sum() if hasattr(view, "segments") else 0)
            continue
        keys, values = c.update_and_fetch(k, k)
        if kind.startswith("mlx-lm"):
            x = mlx_lm_sdpa(x, keys, values, cache=c, scale=D ** -0.5, mask=None)
        else:
            x = _sdpa(x, keys, values, c, D ** -0.5, None)
    return x


def profile(kind: str, ctx: int, layers: int, steps: int) -> dict:
    caches = build(kind, ctx, layers)
    q = mx.random.normal((1, HQ, 1, D)).astype(mx.bfloat16)
    mx.eval(step(kind, caches, q))  # warm-up (compiles kernels)
    t0 = time.perf_counter()
    for _ in range(8):
        g = step(kind, caches, q)
    build_s = (time.perf_counter() - t0) / 8
    mx.eval(g)
    mx.synchronize()
    t0 = time.perf_counter()
    cur = step(kind, caches, q)
    mx.async_eval(cur)
    for _ in range(steps):
        nxt = step(kind, caches, q)
        mx.async_eval(nxt)
        cur.item() if cur.size == 1 else cur[0, 0, 0, 0].item()
        cur = nxt
    mx.eval(cur)
    wall = (time.perf_counter() - t0) / (steps + 1)
    return {"kind": kind, "context": ctx, "layers": layers, "build_ms": build_s * 1e3, "step_ms": wall * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="512,32768")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--kinds", default="mlx-lm,full,affine4-update,affine4,affine4-kernel")
    a = ap.parse_args()
    out = Path(os.environ.get("OUT", "gpu-out"))
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for ctx in [int(c) for c in a.contexts.split(",")]:
        for kind in a.kinds.split(","):
            try:
                r = profile(kind, ctx, a.layers, a.steps)
            except Exception as e:
                r = {"kind": kind, "context": ctx, "error": f"{type(e).__name__}: {str(e)[:160]}"}
            rows.append(r)
            with open(out / "profile.jsonl", "a") as f:
                f.write(json.dumps(r) + "\n")
            print(json.dumps(r), flush=True)
            mx.clear_cache()
    print(f"{'kind':16} {'ctx':>7} {'build ms':>9} {'step ms':>8}")
    for r in rows:
        print(f"{r['kind']:16} {r['context']:>7} {r.get('build_ms', 0):9.2f} {r.get('step_ms', 0):8.2f} {r.get('error', '')}")


if __name__ == "__main__":
    main()
