#!/usr/bin/env python3
"""Generate tok/s and peak memory per KV scheme, mlxkv beside mlx-lm in the same run.

    python scripts/bench_generate.py [-m MODEL] [--prompt-tokens 256] [--gen 256] [--dtype float32] [--out f.json]

Schemes: full, affine 8-bit and 4-bit (group 64, start 0). mlx-lm runs its generate_step with
kv_bits/kv_group_size/quantized_kv_start=0 on the same prompt; where it raises (e.g. head_dim 8
cannot be quantized by mx.quantize, or quantized_matmul on CUDA), the row records the failure.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import mlx.core as mx
from mlx_lm.generate import generate_step

from kvcore.backend import backend_name, versions
from kvcore.engine import GenerateConfig, Request, generate_one, kv_summary
from kvcore.models import load_model
from kvcore.policy import KVOptions, build_caches, resolve_policy

SCHEMES = {"full": None, "affine:8": 8, "affine:4": 4}


def prompt_ids(vocab: int, n: int, seed: int = 0) -> list[int]:
    mx.random.seed(seed)
    return [1] + mx.random.randint(3, vocab, (n - 1,)).tolist()


def run_mlxkv(lm, ids, n, bits):
    opts = KVOptions(kv_bits=bits, quantized_kv_start=0) if bits else KVOptions()
    policy = resolve_policy(opts)
    caches, _ = build_caches(lm.model, policy)
    mx.reset_peak_memory()
    c = generate_one(lm.model, lm.tokenizer, Request(tuple(ids), n), caches, GenerateConfig())
    return {"prompt_tps": c.prompt_tps, "decode_tps": c.gen_tps, "tokens": len(c.token_ids),
            "peak_memory_mb": mx.get_peak_memory() / 2**20, **kv_summary(caches)}


def run_mlx_lm(lm, ids, n, bits):
    kw = {"kv_bits": bits, "kv_group_size": 64, "quantized_kv_start": 0} if bits else {}
    mx.reset_peak_memory()
    try:
        t0 = time.perf_counter()
        toks, t1 = 0, None
        for _ in generate_step(mx.array(ids), lm.model, max_tokens=n, **kw):
            if t1 is None:
                t1 = time.perf_counter()
            toks += 1
        t2 = time.perf_counter()
    except Exception as e:  # a baseline failure is a result to show, not to hide
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
    return {"prompt_tps": len(ids) / (t1 - t0), "decode_tps": (toks - 1) / (t2 - t1) if toks > 1 else 0.0,
            "tokens": toks, "peak_memory_mb": mx.get_peak_memory() / 2**20}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    lm = load_model(a.model, a.dtype)
    vocab = lm.config.get("vocab_size") or lm.config.get("text_config", {}).get("vocab_size")
    ids = prompt_ids(vocab, a.prompt_tokens)
    rows = []
    for name, bits in SCHEMES.items():
        for engine, fn in (("mlxkv", run_mlxkv), ("mlx-lm", run_mlx_lm)):
            fn(lm, ids, 8, bits)  # warm-up
            runs = [fn(lm, ids, a.gen, bits) for _ in range(a.repeats)]
            best = sorted(runs, key=lambda r: r.get("decode_tps", 0))[len(runs) // 2]  # median
            rows.append({"scheme": name, "engine": engine, **best})
            print(json.dumps(rows[-1]))
    meta = {"model": lm.source, "backend": backend_name(), "machine": platform.machine(),
            "prompt_tokens": a.prompt_tokens, "gen_tokens": a.gen, "repeats": a.repeats,
            "date": time.strftime("%Y-%m-%d"), **versions()}
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
