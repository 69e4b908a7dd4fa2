#!/usr/bin/env python3
"""The H200 table of the GPU-decode and long-prompt issues, in one run (< 9 minutes).

Decode cases fill the caches directly (random K/V encoded to the context, as a prefill would
leave them) and then time >= 128 decode steps, the first 8 dropped, mlx-lm in the same
process and interleaved with mlxkv (repeats, median with min..max). Prefill cases feed real
prompts. Writes one JSON in `mlxkv bench --output`'s format to $OUT (and --output), prints
the table and issue 13's P1 as written (`meta.p1`: step(ctx) - step(128) of each compressed one-row case against
its KV bytes / (0.8 B)).

    python scripts/gpu_bench.py [--shape llama-8b] [--gen 128] [--repeats 3] [--output benchmarks/h200-llama-8b.json]
    python scripts/gpu_bench.py --shape llama-tiny --smoke --no-prefill   # the script itself, on a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from kvcore.attention.config import AttentionConfig
from kvcore.backend import CHECKS, backend_name, checks_since, versions
from kvcore.bench.bandwidth import memory_bandwidth
from kvcore.bench.grid import scheme_policy
from kvcore.bench.measure import step_weight_bytes, weight_bytes
from kvcore.bench.shapes import build_random_model
from kvcore.cache import CompressedKVCache
from kvcore.engine import Engine, GenerateConfig, Request, kv_summary
from kvcore.policy import KVOptions, resolve_policy
from kvcore.transient import PrefillMemory

OUT = Path(os.environ.get("OUT", "gpu-out"))
T0 = time.perf_counter()
ROWS: list[dict] = []


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def emit(row: dict) -> None:
    ROWS.append(row)
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "rows.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    log(json.dumps({k: row.get(k) for k in ("engine", "scheme", "context", "batch", "decode_tps", "prefill_tps",
                                            "peak_memory_gb", "error")}))


# -- filling caches directly --------------------------------------------------------------
def fill(caches: list, ctx: int, heads: int, head_dim: int, dtype, piece: int = 8192) -> list:
    """Random K/V for `ctx` tokens into every attention cache, a piece at a time per layer."""
    for c in caches:
        if not isinstance(c, (KVCache, RotatingKVCache, CompressedKVCache)):  # windows too (gemma3's local layers)
            continue
        for lo in range(0, ctx, piece):
            n = min(piece, ctx - lo)
            k = mx.random.normal((1, heads, n, head_dim)).astype(dtype)
            v = mx.random.normal((1, heads, n, head_dim)).astype(dtype)
            c.update_and_fetch(k, v)
            mx.eval([a for a in (c.state if isinstance(c.state, tuple) else [c.state]) if isinstance(a, mx.array)])
    return caches


def rates(stamps: list[float], rows: int, drop: int = 8) -> float:
    """Tokens per second over the decode steps after the first `drop`."""
    if len(stamps) <= drop + 1:
        return 0.0
    return (len(stamps) - 1 - drop) * rows / (stamps[-1] - stamps[drop])


def uneven(mean: int, rows: int) -> list[int]:
    """Row lengths spread evenly over [mean/8, 15 mean/8] (1k..15k for a mean of 8k)."""
    lo, hi = -mean // 8, -mean * 15 // 8
    return [lo + (hi - lo) * i // max(rows - 1, 1) for i in range(rows)]


def mlxkv_decode(model, cfg, scheme: str, ctx: int, rows: int, gen: int, kernel: bool) -> dict:
    policy = scheme_policy(scheme)
    # kernel rows: forced at every context; "default": the shipped config (kernel from cuda_min_tokens,
    # the one-launch encode wherever the kernel is on); False: every CUDA kernel off (the portable paths)
    # "paged": batch rows in pages, the kernel reading them through the block table (not yet the CUDA default)
    if kernel == "default":
        attention = AttentionConfig()
    elif kernel == "paged":
        attention = AttentionConfig(cuda_kernel=True, cuda_min_tokens=0, paged=True)
    else:
        attention = AttentionConfig(cuda_kernel=kernel, cuda_min_tokens=0)
    engine = Engine(model, None, policy, rows, GenerateConfig(prefill_chunk=2048), interleave=False,
                    attention=attention, ignore_eos=True)
    lengths = uneven(ctx, rows) if ctx < 0 else [ctx] * rows  # ctx < 0: rows of 1k..15k tokens, mean -ctx
    filled = [fill(engine.runner.new_caches(), n, cfg["num_key_value_heads"], cfg["head_dim"], mx.bfloat16)
              for n in lengths]
    filled.reverse()
    # pop, not iter(): a list iterator keeps every handed-out row's caches alive after the engine merged them (the
    # batch rows' peaks of runs 5-9 counted the KV twice: full 16 x 8k 59.7 GB for 33.3 of weights and KV)
    engine.runner.new_caches = filled.pop
    for i in range(rows):
        engine.add_request(Request((11 + i,), gen, str(i)))
    mx.synchronize()
    mx.reset_peak_memory()
    stamps = []
    while engine.has_work:
        engine.step()
        if engine.trace and engine.trace[-1][0] == "decode":
            stamps.append(time.perf_counter())
    kv = engine.peak_kv or {}
    return {"decode_tps": rates(stamps, rows), "steps": len(stamps), "peak_memory_gb": mx.get_peak_memory() / 1e9,
            "kv_bytes": kv.get("kv_bytes"), "bits_per_element": kv.get("bits_per_element"),
            "attention": engine.attention_stats.to_json()}


def mlx_lm_decode(model, cfg, ctx: int, gen: int, kv_bits: int | None = None) -> dict:
    from mlx_lm.generate import generate_step

    caches = fill(make_prompt_cache(model), ctx, cfg["num_key_value_heads"], cfg["head_dim"], mx.bfloat16)
    kw = {"kv_bits": kv_bits, "kv_group_size": 64, "quantized_kv_start": 0} if kv_bits else {}
    mx.synchronize()
    mx.reset_peak_memory()
    stamps = []
    try:
        for _ in generate_step(mx.array([11]), model, max_tokens=gen, prompt_cache=caches, **kw):
            stamps.append(time.perf_counter())
    except Exception as e:  # the baseline's failure is a result
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
    return {"decode_tps": rates(stamps, 1), "steps": len(stamps), "peak_memory_gb": mx.get_peak_memory() / 1e9,
            "kv_bytes": sum(c.nbytes for c in caches)}


PREFILL_VARIANTS = {  # issue 14's extra prefill cases at the longest context: (label, KVOptions beyond the scheme)
    "affine:4 start 5000": ("affine:4", {"quantized_kv_start": 5000}),  # a delayed conversion: the array-mask path
    "affine:4 window 8192": ("affine:4", {"max_kv_size": 8192}),
}


def prefill_policy(scheme: str):
    if scheme in PREFILL_VARIANTS:
        base, extra = PREFILL_VARIANTS[scheme]
        return resolve_policy(KVOptions(kv=base, **{"quantized_kv_start": 0, **extra}))
    return scheme_policy(scheme)


def prefill_case(model, config: dict, scheme: str | None, ctx: int) -> dict:
    """Time to first token for a random `ctx`-token prompt (scheme None: mlx-lm bf16)."""
    prompt = mx.random.randint(3, min(30000, model.args.vocab_size), (ctx,)).tolist()
    mx.synchronize()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    if scheme is None:
        from mlx_lm.generate import generate_step
        next(generate_step(mx.array(prompt), model, max_tokens=1, prefill_step_size=2048))
        kv = None
    else:
        policy = prefill_policy(scheme)
        memory = PrefillMemory(model, config, policy)  # as the jobs run it: bounded by the memory model
        engine = Engine(model, None, policy, 1, GenerateConfig(prefill_chunk=2048, prefill_memory=memory),
                        ignore_eos=True)
        engine.run([Request(tuple(prompt), 1, "p")])
        kv = engine.peak_kv.get("kv_bytes")
    mx.synchronize()
    t = time.perf_counter() - t0
    return {"prefill_tps": ctx / t, "ttft_s": t, "peak_memory_gb": mx.get_peak_memory() / 1e9, "kv_bytes": kv}


# tokens of the short prompt each prefill scheme runs first: five chunks, so its past passes the decode kernel's
# cuda_min_tokens (8192) and that plan is built and checked there too (run 14's 4096 left 8-12 s of checks in
# the 128k rows of turbo and the window case)
WARM_PROMPT = 10240

BAND = (165 * 0.85, 165 * 1.15)  # issue 13: a run whose mlx-lm bf16 at 32k is outside 165 +- 15% tok/s is re-run
H200_COPY = 4.3e12  # a device-to-device copy on the H200, where the band was measured


def card_copy(bandwidth: float) -> float:
    """The copy bandwidth the band and P1 scale by: the H200's where the probe reads like one (it reads a little
    below the card's), else the probe's own (an H100 reads ~2.7 TB/s, 0.64 of the H200)."""
    return H200_COPY if bandwidth >= 3.5e12 else bandwidth


def baseline_band(rows: list[dict], bandwidth: float = H200_COPY) -> dict:
    """mlx-lm bf16's decode tok/s at 32k (one row) and whether it is inside issue 13's band, scaled to this card's
    copy bandwidth (mlx-lm's decode is bandwidth-bound), so that a run's ratios say themselves whether they may be
    quoted."""
    tps = next((r.get("decode_tps") for r in rows if r["engine"] == "mlx-lm" and r["scheme"] == "bf16"
                and r["context"] == 32768 and r["batch"] == 1 and r.get("decode_tps")), None)
    f = card_copy(bandwidth) / H200_COPY
    low, high = BAND[0] * f, BAND[1] * f
    return {"tps": tps, "low": low, "high": high, "in_band": tps is not None and low <= tps <= high}


def kv_time(rows: list[dict], bandwidth: float, base: int = 128) -> list[dict]:
    """Issue 13's P1 as it is written: each compressed row's step(ctx) - step(128) (one row, the same scheme and
    kernel setting at `base` tokens) against its compressed KV bytes / (0.8 B), B the larger of the run's probe and
    4.3 TB/s (a device-to-device copy on the H200) where the card is one (`card_copy`)."""
    B = max(bandwidth, card_copy(bandwidth))
    short = {(r["scheme"], str(r.get("kernel"))): r for r in rows if r.get("context") == base and r.get("batch") == 1
             and r["engine"] == "mlxkv" and r.get("decode_tps")}
    out = []
    for r in rows:
        s = short.get((r["scheme"], str(r.get("kernel"))))
        if (s is None or r is s or r["engine"] != "mlxkv" or r.get("batch") != 1 or r.get("context", 0) <= base
                    or not r.get("decode_tps") or not r.get("kv_bytes") or r.get("kind") == "prefill"):
            continue
        step, allowed = 1e3 / r["decode_tps"] - 1e3 / s["decode_tps"], r["kv_bytes"] / (0.8 * B) * 1e3
        out.append({"scheme": r["scheme"], "kernel": r.get("kernel"), "context": r["context"], "base": base,
                    "kv_ms": round(step, 3),
                    "allowed_ms": round(allowed, 3), "met": step <= allowed})
    return out


def paired(mine: list[dict], base: list[dict]) -> dict | None:
    """This row's tok/s over mlx-lm bf16's in the same repeat (adjacent in time, so a drift of the machine
    between repeats cancels): median, min, max of the per-repeat ratios."""
    r = [a["decode_tps"] / b["decode_tps"] for a, b in zip(mine, base)
         if a.get("decode_tps") and b.get("decode_tps")]
    if not r:
        return None
    return {"median": round(statistics.median(r), 3), "min": round(min(r), 3), "max": round(max(r), 3), "n": len(r)}


def case(engine: str, scheme: str, ctx: int, batch: int, runs: list[dict], extra: dict | None = None) -> None:
    ok = [r for r in runs if "error" not in r]
    row = {"engine": engine, "scheme": scheme, "context": ctx, "batch": batch, **(extra or {})}
    if not ok:
        row["error"] = runs[0].get("error", "not run") if runs else "not run"
    else:
        key = "decode_tps" if "decode_tps" in ok[0] else "prefill_tps"
        vals = [r[key] for r in ok]
        best = sorted(ok, key=lambda r: r[key])[len(ok) // 2]
        row.update(best)
        row.update({f"{key}_min": min(vals), f"{key}_max": max(vals), key: statistics.median(vals), "repeats": len(ok)})
    emit(row)
    mx.clear_cache()


def guarded(fn, *a, **k) -> dict:
    try:
        return fn(*a, **k)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}


def main() -> None:
    global T0
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-8b")
    ap.add_argument("--gen", type=int, default=136)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=500, help="skip the remaining cases past this time")
    ap.add_argument("--tests", action="store_true", help="also run the test suite on this device first")
    ap.add_argument("--tests-s", type=float, default=240, help="time limit of the test run")
    ap.add_argument("--output", default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny contexts (a CPU check of the script itself; with a CPU-sized --shape, e.g. llama-tiny)")
    ap.add_argument("--contexts", default=None, help="only the decode cases of these contexts (e.g. 512,32768)")
    ap.add_argument("--no-prefill", action="store_true", help="skip the prefill cases")
    ap.add_argument("--only", default=None,
                    help="only these decode cases, comma-separated ENGINE/SCHEME[/KERNEL] (e.g. mlx-lm/bf16,"
                         "mlxkv/turbo:k4v3/True): KERNEL is the case's kernel setting (True, False, default, paged)")
    ap.add_argument("--prefill-contexts", default=None,
                    help="only these prefill contexts (e.g. 131072: the longest also runs the delayed-start and window cases)")
    a = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if a.tests:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "8",
                            "--timeout", "120"], capture_output=True, text=True, timeout=a.tests_s)
        (OUT / "pytest.log").write_text(r.stdout + r.stderr)
        log(f"tests rc={r.returncode}: {(r.stdout + r.stderr).strip().splitlines()[-1:]}")
        T0 = time.perf_counter()  # the budget counts the bench alone
    bw = memory_bandwidth(1 << 30)
    log(f"bandwidth {bw}")
    model, cfg = build_random_model(a.shape)
    cfg = cfg.get("text_config", cfg)
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    meta = {"backend": backend_name(), "device": mx.device_info().get("device_name", ""), "shape": a.shape,
            "weight_bytes": weight_bytes(model), "step_weight_bytes": step_weight_bytes(model), "weight_bits": 16,
            "bandwidth": bw, "versions": versions(), "date": time.strftime("%Y-%m-%d"), "gen": a.gen}
    log("warm-up")
    mlx_lm_decode(model, cfg, 512, 16)
    mlxkv_decode(model, cfg, "full", 512, 1, 16, False)
    mlxkv_decode(model, cfg, "affine:4", 512, 1, 16, False)
    guarded(mlxkv_decode, model, cfg, "affine:4", 512, 1, 16, True)

    def over() -> bool:
        return time.perf_counter() - T0 > a.budget_s

    plan = [  # (context, rows, [(engine, scheme, kernel)]): the cases that matter most first
        (128, 1, [("mlxkv", "affine:4", True), ("mlxkv", "turbo:k4v3", True)]),  # P1's step(128)
        (512, 1, [("mlx-lm", "bf16", None), ("mlxkv", "full", False), ("mlxkv", "affine:4", False),
                  ("mlxkv", "affine:4", "default"), ("mlxkv", "affine:4", True)]),
        (8192, 16, [("mlxkv", "full", False), ("mlxkv", "affine:4", False), ("mlxkv", "affine:4", True),
                    ("mlxkv", "affine:4", "paged")]),
        (-8192, 16, [("mlxkv", "full", False), ("mlxkv", "affine:4", True), ("mlxkv", "affine:4", "paged")]),  # uneven, mean 8k
        (32768, 1, [("mlx-lm", "bf16", None), ("mlxkv", "full", False), ("mlxkv", "affine:4", False),
                    ("mlxkv", "affine:4", True), ("mlxkv", "affine:8", True), ("mlxkv", "turbo:k4v3", False),
                    ("mlxkv", "turbo:k4v3", True), ("mlx-lm", "affine:4", None)]),
        (131072, 1, [("mlx-lm", "bf16", None), ("mlxkv", "affine:4", False), ("mlxkv", "affine:4", True),
                     ("mlxkv", "turbo:k4v3", True)]),
    ]
    prefills = (32768, 65536, 131072)
    if a.contexts:
        keep = {int(c) for c in a.contexts.split(",")}
        plan = [p for p in plan if p[0] in keep]
    if a.only:
        wanted = [w.split("/") for w in a.only.split(",")]

        def chosen(eng, scheme, kernel):
            return any(w[:2] == [eng, scheme] and (len(w) < 3 or w[2] == str(kernel)) for w in wanted)

        plan = [(c, r, [e for e in engines if chosen(*e)]) for c, r, engines in plan]
        plan = [p for p in plan if p[2]]
    if a.prefill_contexts:
        prefills = tuple(int(c) for c in a.prefill_contexts.split(","))
    if a.no_prefill:
        prefills = ()
    if a.smoke:
        plan = [(c // 256 if abs(c) > 512 else c // 8, min(r, 4), e) for c, r, e in plan]  # 128 -> 16, 512 -> 64
        prefills = () if a.no_prefill else (256, 512)
    for ctx, rows, engines in plan:
        runs = {i: [] for i in range(len(engines))}
        for _ in range(a.repeats if ctx <= 32768 else 2):
            for i, (eng, scheme, kernel) in enumerate(engines):
                if over():
                    break
                if eng == "mlx-lm":
                    bits = None if scheme == "bf16" else int(scheme.split(":")[1])
                    if bits and runs[i]:
                        continue  # a failure needs showing once
                    runs[i].append(guarded(mlx_lm_decode, model, cfg, ctx, a.gen, bits))
                else:
                    runs[i].append(guarded(mlxkv_decode, model, cfg, scheme, ctx, rows, a.gen, kernel))
                mx.clear_cache()
        base = next((j for j, e in enumerate(engines) if e[:2] == ("mlx-lm", "bf16")), None)
        for i, (eng, scheme, kernel) in enumerate(engines):
            extra = {"kernel": kernel} if eng == "mlxkv" else {}
            if eng == "mlxkv" and base is not None:
                extra["x_mlx_lm"] = paired(runs[i], runs[base])
            case(eng, scheme, ctx, rows, runs[i], extra or None)
    first: dict = {}  # scheme -> the first short prompt's seconds (its kernels built and checked: timed apart)
    for ctx in prefills:
        schemes = [None, "affine:4", "turbo:k4v3"] + (list(PREFILL_VARIANTS) if ctx == max(prefills) else [])
        for scheme in schemes:
            if over():
                break
            if scheme not in first:  # a user's first prompt pays this once a process; the rows time the steady cost
                seen = len(CHECKS)
                w = guarded(prefill_case, model, cfg, scheme, min(WARM_PROMPT, ctx))
                checks = checks_since(seen)  # its kernels' builds and checks
                first[scheme] = {"tokens": min(WARM_PROMPT, ctx), "seconds": round(w["ttft_s"], 3) if "ttft_s" in w
                                 else w.get("error"), "checks_s": round(sum(c[2] for c in checks), 3), "checks": checks}
            seen = len(CHECKS)
            r = guarded(prefill_case, model, cfg, scheme, ctx)
            case("mlx-lm" if scheme is None else "mlxkv", scheme or "bf16", ctx, 1, [r],
                 {"kind": "prefill", "first_prompt": first[scheme], "checks": checks_since(seen)})  # none once warm
            if scheme and "ttft_s" in r and r["ttft_s"] > 60:
                break  # the old blockwise prefill: longer contexts would not fit the run
    meta["baseline"] = baseline_band(ROWS, bw["ceiling"])
    meta["p1"] = kv_time(ROWS, bw["ceiling"], 16 if a.smoke else 128)
    doc = {"meta": meta, "rows": ROWS}
    (OUT / "gpu_bench.json").write_text(json.dumps(doc, indent=1))
    if a.output:
        Path(a.output).write_text(json.dumps(doc, indent=1))
    print(f"{'engine':7} {'scheme':11} {'ctx':>7} {'B':>3} {'decode':>8} {'prefill':>8} {'peakGB':>7}  note")
    for r in ROWS:
        print(f"{r['engine']:7} {r['scheme']:11} {r['context']:>7} {r['batch']:>3} {r.get('decode_tps', 0):8.1f} "
              f"{r.get('prefill_tps', 0):8.0f} {r.get('peak_memory_gb', 0):7.2f}  "
              f"{({True: 'kernel ', 'default': 'default '}.get(r.get('kernel'), '')) + (r.get('error') or (r.get('attention') or {}).get('path', ''))}"
              + (f"  x{r['x_mlx_lm']['median']:.2f} ({r['x_mlx_lm']['min']:.2f}-{r['x_mlx_lm']['max']:.2f})" if r.get("x_mlx_lm") else ""))
    for p in meta["p1"]:
        print(f"P1 {p['scheme']} ({'kernel' if p['kernel'] is True else p['kernel']}) at {p['context']}: step - step({p['base']}) "
              f"{p['kv_ms']:.2f} ms against {p['allowed_ms']:.2f} allowed: {'met' if p['met'] else 'missed'}")
    band = meta["baseline"]
    if band["tps"] is not None:
        print(f"mlx-lm bf16 at 32k: {band['tps']:.1f} tok/s, {'inside' if band['in_band'] else 'OUTSIDE'} issue 13's "
              f"{band['low']:.0f}-{band['high']:.0f} band" + ("" if band["in_band"] else ": this run's ratios are not quotable"))


if __name__ == "__main__":
    main()
