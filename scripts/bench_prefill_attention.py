#!/usr/bin/env python3
"""Chunked-prefill attention over a compressed past vs mlx-lm's KVCache, one layer.

Feeds `--context` tokens in `--chunk`-token chunks of random K/V/queries into (a) mlx-lm's
KVCache + `mx.fast.scaled_dot_product_attention(mask="causal")` and (b) mlxkv's
CompressedKVCache + `kv_attention` for each `--kv` scheme, and prints the attention time per
context (cache update + attention, evaluated per chunk), median of `--repeats` runs.
Usage: python scripts/bench_prefill_attention.py --context 4096 --chunk 1024 --kv affine:8,affine:4
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from kvcore.attention.blockwise import kv_attention
from kvcore.cache import CompressedKVCache
from kvcore.policy.kv_spec import parse_kv


def run(make_cache, attend, ctx: int, chunk: int, dims, dtype) -> float:
    B, Hq, H, D = dims
    cache, total = make_cache(), 0.0
    mx.random.seed(0)
    for _ in range(0, ctx, chunk):
        k, v, q = (mx.random.normal(s).astype(dtype) for s in ((B, H, chunk, D), (B, H, chunk, D), (B, Hq, chunk, D)))
        mx.eval(k, v, q)
        t0 = time.perf_counter()
        kk, vv = cache.update_and_fetch(k, v)
        mx.eval(attend(q, kk, vv))
        total += time.perf_counter() - t0
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--kv", default="affine:8,affine:4")
    ap.add_argument("--heads", default="32,8", help="query heads, KV heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    hq, hkv = map(int, a.heads.split(","))
    dims, dtype, scale = (1, hq, hkv, a.head_dim), getattr(mx, a.dtype), a.head_dim ** -0.5
    cases = {"mlx-lm KVCache (full)": (KVCache, lambda q, k, v: mx.fast.scaled_dot_product_attention(
        q, k, v, scale=scale, mask="causal"))}
    for name in a.kv.split(","):
        spec = parse_kv(name)
        cases[f"mlxkv {name}"] = (lambda s=spec: CompressedKVCache(s.key, s.value, recent=s.recent),
                                  lambda q, k, v: kv_attention(q, k, scale))
    for label, (make, attend) in cases.items():
        run(make, attend, a.chunk, a.chunk, dims, dtype)  # warm-up
        times = [run(make, attend, a.context, a.chunk, dims, dtype) for _ in range(a.repeats)]
        print(json.dumps({"case": label, "context": a.context, "chunk": a.chunk, "backend": str(mx.default_device()),
                          "seconds_median": round(statistics.median(times), 4),
                          "tok_per_s": round(a.context / statistics.median(times), 1)}), flush=True)


if __name__ == "__main__":
    main()
