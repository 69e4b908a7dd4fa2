#!/usr/bin/env python3
"""MLX's decode attention over full-precision K/V against the same call with the query heads of each KV head
folded into the query length (kvcore/attention/dense_fold.py): microseconds a call and the largest difference,
llama-8b's heads (32 query heads on 8 KV heads, 128 dims), bf16, K/V sliced from a buffer 256 tokens longer
(as caches hand them). One JSON line per case.

    python3 scripts/gpu_sdpa_fold.py [--cases 16x8192,16x8192m,1x32768,...]   (m: a padded batch's mask)
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx

from kvcore.attention import dense_fold

HQ, HKV, D = 32, 8, 128


def timed(fn, reps: int) -> float:
    mx.eval(fn())
    mx.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


def case(spec: str, reps: int) -> dict:
    masked = spec.endswith("m")
    B, L = (int(x) for x in spec.rstrip("m").split("x"))
    q = mx.random.normal((B, HQ, 1, D)).astype(mx.bfloat16)
    k = mx.random.normal((B, HKV, L + 256, D)).astype(mx.bfloat16)
    v = mx.random.normal((B, HKV, L + 256, D)).astype(mx.bfloat16)
    mx.eval(q, k, v)
    ks, vs = k[:, :, :L], v[:, :, :L]
    mask = (mx.arange(L)[None, None, None, :] >= (mx.arange(B) * 64)[:, None, None, None]) if masked else None
    s = D ** -0.5
    plain = lambda: mx.fast.scaled_dot_product_attention(q, ks, vs, scale=s, mask=mask)
    fold = lambda: dense_fold.attention(q, ks, vs, s, mask)  # the call itself, whatever MLXKV_DENSE_FOLD says
    diff = mx.abs(plain().astype(mx.float32) - fold().astype(mx.float32)).max().item()
    tp, tf = timed(plain, reps), timed(fold, reps)
    kv = 2 * B * HKV * L * D * 2
    return {"case": spec, "plain_us": round(tp, 1), "fold_us": round(tf, 1), "x": round(tp / tf, 2),
            "plain_tbs": round(kv / tp / 1e6, 2), "fold_tbs": round(kv / tf / 1e6, 2), "max_diff": diff}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="16x8192,16x8192m,16x2048,4x32768,1x32768,1x131072,2x512")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    for spec in a.cases.split(","):
        print(json.dumps(case(spec, a.reps)), flush=True)
        mx.clear_cache()


if __name__ == "__main__":
    main()
