#!/usr/bin/env python3
"""Host microseconds per layer of a decode step: a cache's update plus its attention call, as a model
makes them, against mlx-lm's KVCache and SDPA in the same process.

A decode step on an H200 is host-bound (BENCHMARKS.md, "GPU decode, fourth run"): what mlxkv adds per
layer in Python and graph nodes is the gap to mlx-lm at short contexts. This times only that part:
for each kind, `--layers` caches filled to `--context` tokens, then `--steps` single-token updates
round-robin over the layers (each followed by the attention call through mlx-lm's
`scaled_dot_product_attention` name, which mlxkv's caches bind), thread CPU time around each call,
the best of `--repeats` rounds interleaved across kinds. The graph is evaluated once per step of all
layers, outside the timing.

On CUDA everything is real. Elsewhere (`--stand-in`, the default off CUDA) the CUDA kernels and MLX's
fused SDPA are replaced by stand-ins that return zeros of the right shapes and kvcore's selection is
told the backend is CUDA, so the Python of the CUDA paths can be timed on a CPU: figures for A/B of
host code, never for speed claims (a stand-in costs about what a real kernel call costs to build,
not to encode).

    python scripts/host_step.py [--kinds mlx-lm,default,kernel,packed-kernel] [--layers 32] [--context 500]
                                [--scheme affine:4 | turbo:k4v3 | ...]

Kinds: mlx-lm, default (the shipped config), portable (every kernel off), kernel (forced at every
length), packed-kernel / packed-portable (4 packed rows), paged / paged-kernel (4 paged rows).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import time
from pathlib import Path

import mlx.core as mx

OUT = Path(os.environ.get("OUT", "gpu-out"))
KINDS = ("mlx-lm", "default", "portable", "kernel", "packed-kernel", "packed-portable", "paged", "paged-kernel")


def stand_in() -> None:
    """CUDA's kernels and MLX's SDPA as zero-returning stand-ins; kvcore's selection told it is on CUDA."""

    class Kernel:
        def __init__(self, **kw):
            pass

        def __call__(self, *, inputs, output_shapes, output_dtypes, **kw):
            return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]

    mx.fast.cuda_kernel = Kernel
    mx.fast.scaled_dot_product_attention = (
        lambda q, k, v, scale=1.0, mask=None, sinks=None, **kw: mx.zeros((*q.shape[:3], v.shape[-1]), dtype=q.dtype))
    import kvcore.backend as kb

    kb._backend = lambda cpu: "cuda"
    from kvcore.attention import cuda_check, cuda_encode
    from kvcore.codecs import turbo_cuda, turbo_cuda_encode

    cuda_check.check_plan = lambda plan, dtype: None
    cuda_encode.check = lambda *a: None
    turbo_cuda.check = turbo_cuda_encode.check = lambda *a: None


def caches(kind: str, layers: int, rows: int, context: int, heads: int, dim: int, dtype=mx.bfloat16,
           scheme: str = "affine:4") -> list:
    from mlx_lm.models.cache import KVCache

    from kvcore.attention.config import AttentionConfig
    from kvcore.bench.grid import scheme_policy
    from kvcore.cache import BatchCompressedKVCache, CompressedKVCache

    att = {"default": AttentionConfig(), "portable": AttentionConfig(cuda_kernel=False, paged=False),
           "paged": AttentionConfig(cuda_kernel=False, paged=True),
           "paged-kernel": AttentionConfig(cuda_kernel=True, cuda_min_tokens=0, paged=True)}.get(
        kind if kind.startswith("paged") else kind.removeprefix("packed-"),
        AttentionConfig(cuda_kernel=True, cuda_min_tokens=0, paged=False))
    out = []
    for _ in range(layers):
        made = []
        for b in range(rows):
            pol = scheme_policy(scheme)
            c = KVCache() if kind == "mlx-lm" else CompressedKVCache(pol.codec, pol.value_codec, start=0, attention=att)
            k = mx.random.normal((1, heads, context + 10 * b, dim)).astype(dtype)
            c.update_and_fetch(k, k)
            made.append(c)
        c = made[0] if rows == 1 else BatchCompressedKVCache(made)
        if rows > 1:
            c._maybe_pack()
        mx.eval(c.state)
        out.append(c)
    return out


def run(cs: list, steps: int, rows: int, heads: int, dim: int, q_heads: int, dtype=mx.bfloat16) -> tuple[float, float]:
    from mlx_lm.models import base

    sdpa = base.scaled_dot_product_attention  # mlxkv's binding once its caches exist (as a model calls it)
    q = mx.random.normal((rows, q_heads, 1, dim)).astype(dtype)
    k1 = mx.random.normal((rows, heads, 1, dim)).astype(dtype)
    mx.eval(q, k1)
    tu = ta = 0.0
    outs = []
    for i in range(steps):
        c = cs[i % len(cs)]
        a = time.thread_time()
        kk, vv = c.update_and_fetch(k1, k1)
        b = time.thread_time()
        outs.append(sdpa(q, kk, vv, cache=c, scale=dim**-0.5, mask=None))
        e = time.thread_time()
        tu, ta = tu + b - a, ta + e - b
        if i % len(cs) == len(cs) - 1:
            mx.eval(outs, [x.state for x in cs])
            outs = []
    return tu / steps * 1e6, ta / steps * 1e6


def python_calls(cs, steps, *shape) -> float:
    prof = cProfile.Profile()
    prof.enable()
    run(cs, steps, *shape)
    prof.disable()
    return pstats.Stats(prof).total_calls / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", default="mlx-lm,default,kernel,packed-kernel")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--context", type=int, default=500)
    ap.add_argument("--rows", type=int, default=4, help="rows of the packed kinds")
    ap.add_argument("--steps", type=int, default=960)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--stand-in", choices=("auto", "yes", "no"), default="auto")
    ap.add_argument("--dtype", default="bfloat16", help="K/V and query dtype (float32 for real CPU runs: bf16 is slow there)")
    ap.add_argument("--scheme", default="affine:4", help="the KV scheme of mlxkv's kinds (e.g. turbo:k4v3)")
    a = ap.parse_args()
    from kvcore.backend import backend_name, versions

    real = backend_name() == "cuda"
    stood_in = a.stand_in == "yes" or (a.stand_in == "auto" and not real)
    if stood_in:
        stand_in()
        real = False
    dtype = getattr(mx, a.dtype)
    heads, dim, q_heads = 8, 128, 32
    kinds = a.kinds.split(",")
    for k in kinds:
        if k not in KINDS:
            raise SystemExit(f"unknown kind {k!r} (known: {', '.join(KINDS)})")
    batched = lambda k: k.startswith(("packed", "paged"))
    sets = {k: caches(k, a.layers, a.rows if batched(k) else 1, a.context, heads, dim, dtype, a.scheme) for k in kinds}
    shape = {k: (a.rows if batched(k) else 1, heads, dim, q_heads, dtype) for k in kinds}
    best: dict = {}
    for _ in range(a.repeats):
        for k in kinds:
            r = run(sets[k], a.steps, *shape[k])
            if k not in best or sum(r) < sum(best[k]):
                best[k] = r
    base = sum(best[kinds[0]])
    rows = []
    for k in kinds:
        u, t = best[k]
        rows.append({"kind": k, "update_us": round(u, 2), "attention_us": round(t, 2), "total_us": round(u + t, 2),
                     "x_first": round((u + t) / base, 2), "python_calls": round(python_calls(sets[k], 320, *shape[k]), 1),
                     "rows": shape[k][0], "scheme": None if k == "mlx-lm" else a.scheme, "layers": a.layers, "context": a.context, "real_kernels": real,
                     "backend": "cpu (CUDA paths with stand-ins)" if stood_in else backend_name(), "dtype": a.dtype,
                     **versions()})
        print(json.dumps(rows[-1]), flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "host_step.jsonl", "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"{'kind':16} {'update':>8} {'attend':>8} {'total':>8} {'x':>5} {'py calls':>9}  (us per layer)")
    for r in rows:
        print(f"{r['kind']:16} {r['update_us']:8.1f} {r['attention_us']:8.1f} {r['total_us']:8.1f} {r['x_first']:5.2f} "
              f"{r['python_calls']:9.0f}")


if __name__ == "__main__":
    main()
