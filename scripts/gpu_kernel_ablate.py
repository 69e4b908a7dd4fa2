#!/usr/bin/env python3
"""What each part of the tensor-core decode body costs: the kernel's own wall time per launch, over
random 4-bit K/V (llama-8b's attention: 32 query heads on 8 KV heads, 128 dims, group 64, 1 row), with
one part of its text taken out at a time. The ablated kernels compute wrong results by design and run
outside the device check (called directly, never through attention); only their times mean anything.

    python3 scripts/gpu_kernel_ablate.py [--form 2] [--context 32768] [--launches 50] [--variants full,no-kdeq]

Variants: full; no-kdeq / no-vdeq (codes into the fragments without scale and bias: no HADD2/HFMA2);
no-kmma / no-vmma (the score / value mma replaced by one dependent add); no-loads (form 2: nothing staged,
the ring read as it is); split-only (the launch writes its splits' partials, no in-launch merge). Prints a
line per variant: us per launch and its share of `full`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import mlx.core as mx

from kvcore.attention import cuda_kernels as ck
from kvcore.attention import cuda_form3, cuda_mma, cuda_stage
from kvcore.attention import cuda_source as src
from kvcore.attention.cuda_launch import BIG, Plan, Side
from kvcore.codecs import CodecSpec
from kvcore.codecs.affine import AffineCodec

HQ, HKV, D = 32, 8, 128
FAKE = r"""
__device__ __forceinline__ void fake_mma(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  d[0] += __uint_as_float((a0 ^ a1 ^ a2 ^ a3 ^ b0 ^ b1) & 0x3fffffffu) * 1e-30f;
}
__device__ __forceinline__ uint32_t nodeq(uint32_t codes, __half2 s, __half2 z) { return codes | 0x64006400u; }
"""
# text substitutions per variant and form: (old, new); every one must match
EDITS = {
    "no-kdeq": {1: [("b0 = deq2(", "b0 = nodeq("), ("b1 = deq2(", "b1 = nodeq(")],
                **{f: [(f"a{i} = deq2(", f"a{i} = nodeq(") for i in range(4)] for f in (2, 3)}},
    "no-vdeq": {f: [("a[r] = deq2(", "a[r] = nodeq(")] for f in (1, 2, 3)},
    "no-kmma": {1: [("mma16816(s[nb],", "fake_mma(s[nb],")],
                **{f: [("mma16816(i & 1 ? s2 : s,", "fake_mma(i & 1 ? s2 : s,")] for f in (2, 3)}},
    "no-vmma": {f: [("mma16816(acc[m],", "fake_mma(acc[m],")] for f in (1, 2, 3)},
    "no-loads": {2: [("      stage_rows<KRW", "      if (false) stage_rows<KRW"), ("      stage_rows<VRW", "      if (false) stage_rows<VRW")]
                 + [(f"      stage_meta<{n}>(st + SOFF_{x}", f"      if (false) stage_meta<{n}>(st + SOFF_{x}")
                    for n, x in (("KNG", "KS"), ("KNG", "KZ"), ("VNG", "VS"), ("VNG", "VZ"))]},
}


def ablated_body(form: int, variant: str) -> str:
    text = {1: cuda_mma.BODY, 2: cuda_stage.BODY, 3: cuda_form3.BODY}[form]
    for old, new in EDITS.get(variant, {}).get(form, []):
        if old not in text:
            raise SystemExit(f"variant {variant}: {old!r} is not in form {form}'s text")
        text = text.replace(old, new)
    return src.compact(src.PROLOGUE + text + src.TAIL)


def kernel_for(plan: Plan, variant: str, fused: bool, out_dtype):
    consts = [*plan.template, ("FUSED", fused), ("HAS_SINK", False), ("OT", "__nv_bfloat16")]
    header = ck.header(True, cuda_mma.min_blocks(plan.value.dim))
    head, bounds = header.split("#undef __global__")  # the fakes go before the launch bounds
    return mx.fast.cuda_kernel(
        name=f"mlxkv_ablate_{plan.mma}_{variant.replace('-', '_')}", input_names=src.INPUTS,
        output_names=src.OUTPUTS, source=ck._source_constants(consts) + ablated_body(int(plan.mma), variant),
        header=head + src.compact(FAKE) + "#undef __global__" + bounds, ensure_row_contiguous=False,
        shared_memory=plan.smem)


def inputs(ctx: int):
    side = Side("affine", 4, 64, D)
    codec = AffineCodec(CodecSpec("affine", 4, 64), D)
    parts = []
    for seed in (1, 2):
        enc = []
        for lo in range(0, ctx, 8192):  # encoded in pieces: bounded float32 scratch
            x = mx.random.normal((1, HKV, min(8192, ctx - lo), D), key=mx.random.key(seed + lo))
            enc.append(codec.encode(x))
            mx.eval(enc[-1])
        parts.append(tuple(mx.concatenate([e[i] for e in enc], axis=2) for i in range(3)))
    rows = mx.array([(-BIG, ctx, ctx)], dtype=mx.int32)
    launch = ck.Launch(side, side, parts[0], parts[1], ck.dummy(mx.float32), ck.dummy(mx.float32), rows, ctx)
    q = mx.random.normal((1, HQ, 1, D)).astype(mx.bfloat16)
    return q, launch


def time_variant(q, launch, plan: Plan, variant: str, launches: int) -> float:
    fused = variant != "split-only"
    k = kernel_for(plan, "full" if variant == "split-only" else variant, fused, q.dtype)

    def run():
        return ck.partials(q, launch, plan, D ** -0.5, HKV, fused=fused, kernel=k)

    for _ in range(3):
        mx.eval(run())
    mx.synchronize()
    outs = [run() for _ in range(launches)]  # graphs built first: the timed part is their evaluation
    t0 = time.perf_counter()
    mx.eval(outs)
    mx.synchronize()
    return (time.perf_counter() - t0) / launches * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--form", type=int, default=2, choices=(1, 2, 3))
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--launches", type=int, default=50)
    ap.add_argument("--variants", default="full,no-kdeq,no-vdeq,no-kmma,no-vmma,no-loads,split-only")
    a = ap.parse_args()
    side = Side("affine", 4, 64, D)
    plan = Plan(side, side, HQ // HKV, 1, False, a.form)
    variants = [v for v in a.variants.split(",") if v in ("full", "split-only") or a.form in EDITS.get(v, {})]
    for v in variants:
        ablated_body(a.form, v)  # every substitution applies, before any device time is spent
    if os.environ.get("MLXKV_ABLATE_TEXT_ONLY"):
        print("texts ok:", ", ".join(variants))
        return
    q, launch = inputs(a.context)
    times = {v: time_variant(q, launch, plan, v, a.launches) for v in variants}
    out = Path(os.environ.get("OUT", "gpu-out"))
    out.mkdir(parents=True, exist_ok=True)
    with (out / "ablate.jsonl").open("a") as f:
        f.write(json.dumps({"form": a.form, "context": a.context, "us": times}) + "\n")
    full = times.get("full") or 1.0
    for v, t in times.items():
        print(f"form {a.form} ctx {a.context} {v:11} {t:8.1f} us  {t / full:5.2f}x of full")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
