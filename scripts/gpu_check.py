#!/usr/bin/env python3
"""One GPU session's checks and timings, results as JSON lines under $OUT (or ./gpu-out).

  1. the correctness tests on the CUDA device (pytest subset, log kept);
  2. mlx-lm's quantized KV on CUDA vs mlxkv's portable path on the same random model;
  3. decode/prefill speed on a random-weight shape: mlxkv (full, affine 8, affine 4) beside
     mlx-lm in the same run. Weights are random (speed and memory only).

    python scripts/gpu_check.py [--shape llama-8b] [--contexts 2048,16384] [--batches 1,8] [--gen 64] [--skip-tests]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx

from kvcore.backend import backend_name, versions
from kvcore.bench import build_random_model, measure_mlx_lm, measure_mlxkv, seeded_prompts, weight_bytes
from kvcore.codecs import CodecSpec
from kvcore.policy import KVPolicy

OUT = Path(os.environ.get("OUT", "gpu-out"))
SCHEMES = {"full": None, "affine:8": 8, "affine:4": 4}


def emit(name: str, obj: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"t": round(time.time(), 1), **obj})
    print(line, flush=True)
    with open(OUT / name, "a") as f:
        f.write(line + "\n")


def run_tests(paths: list[str]) -> None:
    log = OUT / "pytest.log"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths],
                       capture_output=True, text=True, timeout=420)
    log.write_text(r.stdout + r.stderr)
    emit("results.jsonl", {"step": "tests", "rc": r.returncode, "tail": (r.stdout + r.stderr)[-600:]})


def kernel_attention(q: mx.array, key_parts, value_parts, codec, lengths: mx.array, scale: float) -> mx.array:
    """The decode kernel over packed rows: q (B, Hq, N, D); parts (B, Hkv, CAP, ...) with row b valid on
    [0, lengths[b]) -> (B, Hq, N, Dv)."""
    from kvcore.attention import cuda_decode
    from kvcore.attention.cuda_kernels import Launch
    from kvcore.attention.cuda_launch import BIG

    sides = cuda_decode._sides(codec, codec, key_parts, value_parts, (q.shape[-1], codec.head_dim), False)
    N = q.shape[2]
    n = lengths.astype(mx.int32)
    rows = mx.stack([mx.full(n.shape, -BIG, dtype=mx.int32), n - N + 1, n], axis=1)
    out = cuda_decode.attend(q, None if sides is None else [Launch(*sides, rows, key_parts[0].shape[2])],
                             key_parts[0].shape[1], scale, None)
    if out is None:
        raise SystemExit("error: the CUDA decode kernel does not cover this case here")
    return out


def check_kernel() -> None:
    """The CUDA decode kernel against the portable path on random shapes (GQA, uneven rows)."""
    from kvcore.attention import cuda_decode
    from kvcore.codecs import AffineCodec

    ready = backend_name() == "cuda"
    emit("results.jsonl", {"step": "cuda-kernel-selfcheck", "ready": ready, **cuda_decode.status()})
    if not ready:
        return
    for hq, hkv, d, bits, lens in ((8, 2, 128, 4, (1, 300, 1000)), (32, 8, 128, 8, (4096, 17)),
                                   (16, 16, 64, 4, (513,)), (12, 4, 64, 2, (2000, 1999, 7))):
        codec = AffineCodec(CodecSpec("affine", bits, 64), d)
        T, B = max(lens), len(lens)
        k, v = mx.random.normal((B, hkv, T, d)), mx.random.normal((B, hkv, T, d))
        q = mx.random.normal((B, hq, 1, d)).astype(mx.bfloat16)
        ke, ve = codec.encode(k), codec.encode(v)
        lengths = mx.array(lens)
        got = kernel_attention(q, ke, ve, codec, lengths, d ** -0.5).astype(mx.float32)
        kd, vd = codec.decode(ke, mx.float32), codec.decode(ve, mx.float32)
        mask = (mx.arange(T)[None] < lengths[:, None])[:, None, None]
        want = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), kd, vd, scale=d ** -0.5, mask=mask)
        emit("results.jsonl", {"step": "cuda-kernel-vs-portable", "hq": hq, "hkv": hkv, "d": d, "bits": bits,
                               "lengths": list(lens), "max_abs_err": mx.abs(got - want).max().item()})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-8b")
    ap.add_argument("--contexts", default="2048,16384")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-kv-bits-demo", action="store_true", help="skip showing mlx-lm's kv_bits failure")
    ap.add_argument("--tests", default="tests/test_attention_blockwise.py,tests/test_codec_affine.py,"
                    "tests/test_generate.py,tests/test_batch.py,tests/test_conversion.py")
    a = ap.parse_args()
    emit("results.jsonl", {"step": "env", "backend": backend_name(), "device": str(mx.default_device()),
                           **versions(), "device_info": {k: str(v) for k, v in mx.device_info().items()}})
    if not a.skip_tests:
        run_tests(a.tests.split(","))
    check_kernel()
    model, config = build_random_model(a.shape, None, mx.bfloat16)
    wbytes = weight_bytes(model)
    emit("results.jsonl", {"step": "model", "shape": a.shape, "weights": "random", "weight_bytes": wbytes})
    # mlx-lm's quantized attention on CUDA, one short row
    if not a.skip_kv_bits_demo:
        p = seeded_prompts(config["vocab_size"], 1, 512)
        emit("results.jsonl", {"step": "mlx-lm-kv-bits-cuda", **measure_mlx_lm(model, 4, 64, p, 8)})
    for context in map(int, a.contexts.split(",")):
        for batch in map(int, a.batches.split(",")):
            prompts = seeded_prompts(config["vocab_size"], batch, context)
            for name, bits in SCHEMES.items():
                policy = KVPolicy(CodecSpec("affine", bits, 64) if bits else CodecSpec("full"), start=0,
                                  max_kv_size=None)
                if bits is None:
                    policy = KVPolicy(max_kv_size=None)  # mlx-lm's own caches: plain dense baseline path
                measure_mlxkv(model, policy, [q[:256] for q in prompts[:1]], 4)  # warm-up
                r = measure_mlxkv(model, policy, prompts, a.gen)
                emit("results.jsonl", {"step": "speed", "engine": "mlxkv", "scheme": name, "context": context,
                                       "batch": batch, **r})
                if bits is None:  # mlx-lm's quantized KV fails on CUDA: shown once above
                    measure_mlx_lm(model, None, 64, [q[:256] for q in prompts[:1]], 4)  # warm-up
                    r = measure_mlx_lm(model, bits, 64, prompts, a.gen)
                    emit("results.jsonl", {"step": "speed", "engine": "mlx-lm", "scheme": name, "context": context,
                                           "batch": batch, **r})
                mx.clear_cache()


if __name__ == "__main__":
    main()
