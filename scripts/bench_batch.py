#!/usr/bin/env python3
"""Aggregate decode tok/s and peak memory for N concurrent rows, per KV scheme, mlxkv's
continuous batching beside mlx-lm's batch_generate (BatchGenerator, full-precision KV: it
cannot quantize) in the same run and dtype.

    python scripts/bench_batch.py [-m MODEL] [--rows 1,4,16] [--prompt-tokens 128] [--gen 128] [--out f.json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import time

import mlx.core as mx

from kvcore.backend import backend_name, versions
from kvcore.engine import GenerateConfig, Request
from kvcore.engine import Engine
from kvcore.models import load_model
from kvcore.policy import KVOptions, resolve_policy

SCHEMES = {"full": KVOptions(), "affine:8": KVOptions(kv_bits=8, quantized_kv_start=0),
           "affine:4": KVOptions(kv_bits=4, quantized_kv_start=0)}


def prompts(vocab, rows, n, seed=0):
    mx.random.seed(seed)
    return [[1] + mx.random.randint(3, vocab, (n - 1,)).tolist() for _ in range(rows)]


def run_mlxkv(lm, ps, gen, opts):
    policy = resolve_policy(opts)
    reqs = [Request(tuple(p), gen, str(i)) for i, p in enumerate(ps)]
    engine = Engine(lm.model, lm.tokenizer, policy, len(ps), GenerateConfig())
    engine.ignore_eos = True  # benchmark fixed lengths
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    out = engine.run(reqs)
    wall = time.perf_counter() - t0
    toks = sum(len(c.token_ids) for c in out)
    decode = max(c.gen_time for c in out)
    return {"tokens": toks, "wall_s": wall, "aggregate_tps": toks / wall, "decode_tps": toks / decode,
            "peak_memory_mb": mx.get_peak_memory() / 2**20, "kv_bytes": engine.peak_kv.get("kv_bytes")}


def run_mlx_lm(lm, ps, gen):
    g = importlib.import_module("mlx_lm.generate")
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    gen_ = g.BatchGenerator(lm.model, stop_tokens=[], completion_batch_size=len(ps), prefill_batch_size=len(ps))
    gen_.insert(ps, [gen] * len(ps))
    toks, t_first = 0, None
    while responses := gen_.next_generated():
        if t_first is None:
            t_first = time.perf_counter()
        toks += len(responses)
    wall = time.perf_counter() - t0
    gen_.close()
    return {"tokens": toks, "wall_s": wall, "aggregate_tps": toks / wall,
            "decode_tps": (toks - len(ps)) / (time.perf_counter() - t_first),
            "peak_memory_mb": mx.get_peak_memory() / 2**20}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    lm = load_model(a.model, a.dtype)
    cfg = lm.config.get("text_config", lm.config)
    out = []
    for rows in map(int, a.rows.split(",")):
        ps = prompts(cfg["vocab_size"], rows, a.prompt_tokens)
        run_mlx_lm(lm, ps[:1], 4)  # warm-up
        out.append({"rows": rows, "scheme": "full", "engine": "mlx-lm", **run_mlx_lm(lm, ps, a.gen)})
        print(json.dumps(out[-1]))
        for name, opts in SCHEMES.items():
            run_mlxkv(lm, ps[:1], 4, opts)  # warm-up
            out.append({"rows": rows, "scheme": name, "engine": "mlxkv", **run_mlxkv(lm, ps, a.gen, opts)})
            print(json.dumps(out[-1]))
    meta = {"model": lm.source, "dtype": a.dtype, "backend": backend_name(), "machine": platform.machine(),
            "prompt_tokens": a.prompt_tokens, "gen_tokens": a.gen, "date": time.strftime("%Y-%m-%d"), **versions()}
    print(json.dumps(meta))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
