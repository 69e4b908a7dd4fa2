#!/usr/bin/env python3
"""The CUDA decode kernel on the device: correctness on random shapes, then kernel vs portable timings.

  python3 scripts/gpu_kernel_check.py [--quick]        (on a CUDA machine; JSON under $OUT or ./gpu-out)

1. `check` (a subprocess, so a crash cannot take the timings with it): every plan of the matrix
   (affine 2/3/4/5/6/8 bits, mixed key/value bits, TurboQuant, dense bf16/fp16/fp32, head_dim
   64/128/256, GQA 1-8, 1-8 queries, query dtypes) against a float32 reference (kvcore.attention.
   cuda_check), and end to end through real caches (recent tokens, windows, packed uneven rows,
   the rotated basis): kv_attention/packed_attention with the kernel == without.
2. `time`: llama-8b-like heads (32 q heads, 8 kv heads, head_dim 128), 1 and 16 rows at 4k / 32k /
   128k tokens (and 16 uneven rows of 1k-15k), affine:4, affine:8, turbo:k4v3, full bf16: one
   attention call with the kernel and with the portable path, over several distinct caches (so L2
   does not hold them), against the floor KV bytes / 4.3 TB/s; a read-bandwidth probe.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(os.environ.get("OUT", "gpu-out"))
FLOOR_BW = 4.3e12  # bytes/s: a device-to-device copy measured on this card (issue 13)


def _write(name: str, obj) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / name).write_text(json.dumps(obj, indent=1, default=str))


# -- 1. correctness -----------------------------------------------------------------------------------
def check_matrix(quick: bool):
    from kvcore.attention.cuda_launch import Plan, Side

    A = lambda b, d, g=64: Side("affine", b, g, d)
    T = lambda b, d: Side("turbo", b, d, d)
    plans = [(Plan(A(b, d), A(b, d), 4, 1), "bfloat16") for b in (2, 3, 4, 5, 6, 8) for d in (64, 128, 256)]
    plans += [(Plan(A(4, 128), A(4, 128), r, 1), "bfloat16") for r in (1, 2, 8)]
    plans += [(Plan(A(8, 64), A(8, 64), 8, 1), "bfloat16"), (Plan(A(8, 64), A(8, 64), 1, 8), "bfloat16")]
    plans += [(Plan(A(4, 128), A(4, 128), 4, n), "bfloat16") for n in (2, 4, 8)]
    plans += [(Plan(A(8, 128), A(4, 128), 4, 1), "bfloat16"), (Plan(A(4, 128, 32), A(2, 128, 32), 4, 1), "bfloat16"),
              (Plan(A(6, 256, 128), A(3, 256, 128), 2, 3), "bfloat16")]
    plans += [(Plan(T(kb, d), T(vb, d), 4, 1), "bfloat16") for kb, vb, d in
              ((4, 3, 64), (4, 3, 128), (4, 3, 256), (8, 5, 128), (3, 2, 128), (4, 3, 128))][:5]
    plans += [(Plan(T(4, 128), T(3, 128), 4, 4), "float32")]
    plans += [(Plan(Side.dense(t, d), Side.dense(t, d), 4, 1), t) for t, d in
              (("bfloat16", 64), ("bfloat16", 128), ("bfloat16", 256), ("float16", 128), ("float32", 128))]
    plans += [(Plan(Side.dense("bfloat16", 128), Side.dense("bfloat16", 128), 4, 4), "bfloat16")]
    plans += [(Plan(A(4, 128), A(4, 128), 4, 1), t) for t in ("float16", "float32")]
    # the tensor-core body (cuda_mma.py) of every plan it covers, as plan_for picks it for these queries
    from kvcore.attention.cuda_mma import mma_fits

    plans += [(Plan(p.key, p.value, p.rep, p.n_queries, p.paged, form), t) for form in (1, 2) for p, t in plans
              if mma_fits(p.key, p.value, p.rep, p.n_queries, t)
              and Plan(p.key, p.value, p.rep, p.n_queries, p.paged, form).why_not() is None]  # turbo: form 1 only
    return plans[::4] if quick else plans


def run_checks(quick: bool, shard: int, shards: int) -> None:
    import mlx.core as mx

    from kvcore.attention import cuda_decode
    from kvcore.attention.cuda_check import check_plan

    rows, t_start = [], time.time()
    name = f"kernel_checks_{shard}.json"
    for plan, qdt in (check_matrix(quick)[shard::shards] if shard < shards else []):
        t = time.time()
        row = {"plan": cuda_decode.describe(plan, qdt), "tile": plan.tile, "smem": plan.smem}
        try:
            row["admitted"] = cuda_decode.admitted(plan, getattr(mx, qdt))  # the first-use check (seed 0)
            row["verdict"] = cuda_decode.status()[cuda_decode.describe(plan, qdt)]
            row["seed1"] = check_plan(plan, getattr(mx, qdt), seed=1)  # fresh inputs
        except Exception as e:  # noqa: BLE001 - recorded, the next plan runs
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        row["s"] = round(time.time() - t, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
        _write(name, {"checks": rows, "elapsed_s": time.time() - t_start})
    e2e = end_to_end() if shard == shards else []  # one more process: real caches end to end
    _write(name, {"checks": rows, "end_to_end": e2e, "elapsed_s": time.time() - t_start})


def end_to_end() -> list:
    """Real caches: kernel vs portable through kv_attention / packed_attention / the rotated basis."""
    import mlx.core as mx

    from kvcore.attention import blockwise
    from kvcore.attention.config import AttentionConfig
    from kvcore.attention.cuda_check import relative_error
    from kvcore.attention.rotated import in_rotated_basis
    from kvcore.cache import BatchCompressedKVCache, CompressedKVCache
    from kvcore.codecs import CodecSpec

    on, off = AttentionConfig(cuda_kernel=True, cuda_min_tokens=0), AttentionConfig(cuda_kernel=False)
    bf = mx.bfloat16
    out = []

    def spec(name, bits):
        return CodecSpec(name, bits, 64 if name == "affine" else None)

    cases = [("affine4 recent16", ("affine", 4, 4), {"recent": 16}, 2000, 1),
             ("affine8 window512 keep4", ("affine", 8, 8), {"window": 512, "keep": 4}, 3000, 1),
             ("affine k8v4 verify4", ("affine", 8, 4), {}, 1500, 4),
             ("turbo k4v3 recent8", ("turbo", 4, 3), {"recent": 8}, 1800, 1),
             ("full bf16", ("full", None, None), {}, 900, 1)]
    for label, (name, kb, vb), kw, T, N in cases:
        try:
            mx.random.seed(3)
            c = CompressedKVCache(spec(name, kb), spec(name, vb), 0, attention=on, **kw)
            c.update_and_fetch(mx.random.normal((1, 8, T, 128)).astype(bf), mx.random.normal((1, 8, T, 128)).astype(bf))
            view, _ = c.update_and_fetch(mx.random.normal((1, 8, N, 128)).astype(bf),
                                         mx.random.normal((1, 8, N, 128)).astype(bf))
            q = mx.random.normal((1, 32, N, 128)).astype(bf)
            got = in_rotated_basis(blockwise.kv_attention, q, view, 128**-0.5, None, on)
            want = in_rotated_basis(blockwise.kv_attention, q, view, 128**-0.5, None, off)
            out.append({"case": label, "rel_err": relative_error(got, want), "calls": dict(c.stats.calls),
                        "segments": [s.kind for s in view.segments]})
        except Exception as e:  # noqa: BLE001
            out.append({"case": label, "error": f"{type(e).__name__}: {e}"[:400]})
        print(json.dumps(out[-1]), flush=True)
    for label, (name, kb, vb) in (("packed affine4 16 rows 100-5000", ("affine", 4, 4)),
                                  ("packed full bf16 16 rows 100-5000", ("full", None, None)),
                                  ("packed turbo k4v3 16 rows", ("turbo", 4, 3))):
        try:
            mx.random.seed(4)
            rows = []
            for n in range(100, 5001, 326):
                r = CompressedKVCache(spec(name, kb), spec(name, vb), 0, attention=on)
                r.update_and_fetch(mx.random.normal((1, 8, n, 128)).astype(bf), mx.random.normal((1, 8, n, 128)).astype(bf))
                rows.append(r)
            batch = BatchCompressedKVCache(rows)
            pv, _ = batch.update_and_fetch(mx.random.normal((16, 8, 1, 128)).astype(bf),
                                           mx.random.normal((16, 8, 1, 128)).astype(bf))
            q = mx.random.normal((16, 32, 1, 128)).astype(bf)
            got = in_rotated_basis(blockwise.packed_attention, q, pv, 128**-0.5, None, on)
            want = in_rotated_basis(blockwise.packed_attention, q, pv, 128**-0.5, None, off)
            out.append({"case": label, "rel_err": relative_error(got, want), "calls": dict(rows[0].stats.calls),
                        "view": type(pv).__name__})
        except Exception as e:  # noqa: BLE001
            out.append({"case": label, "error": f"{type(e).__name__}: {e}"[:400]})
        print(json.dumps(out[-1]), flush=True)
    return out


# -- 2. timings -----------------------------------------------------------------------------------------
def _fill_row(spec_k, spec_v, T, cfg, dtype):
    import mlx.core as mx

    from kvcore.cache import CompressedKVCache

    c = CompressedKVCache(spec_k, spec_v, 0, attention=cfg)
    for lo in range(0, T, 16384):  # bounded transients
        n = min(16384, T - lo)
        c.update_and_fetch(mx.random.normal((1, 8, n, 128)).astype(dtype), mx.random.normal((1, 8, n, 128)).astype(dtype))
        mx.eval(c.state)
    return c


def _views(scheme: str, lengths: list[int], n_views: int):
    """n_views distinct (view, KV bytes) pairs of the scheme: a KVView for one row, a PackedView for several."""
    import mlx.core as mx

    from kvcore.attention.config import AttentionConfig
    from kvcore.cache import BatchCompressedKVCache
    from kvcore.codecs import CodecSpec

    name, kb, vb = {"affine:4": ("affine", 4, 4), "affine:8": ("affine", 8, 8), "turbo:k4v3": ("turbo", 4, 3),
                    "full": ("full", None, None)}[scheme]
    sk = CodecSpec(name, kb, 64 if name == "affine" else None)
    sv = CodecSpec(name, vb, 64 if name == "affine" else None)
    cfg = AttentionConfig(cuda_kernel=True, cuda_min_tokens=0)
    bf = mx.bfloat16
    views = []
    for _ in range(n_views):
        rows = [_fill_row(sk, sv, n, cfg, bf) for n in lengths]
        cache = rows[0] if len(rows) == 1 else BatchCompressedKVCache(rows)
        B = len(rows)
        view, _ = cache.update_and_fetch(mx.random.normal((B, 8, 1, 128)).astype(bf),
                                         mx.random.normal((B, 8, 1, 128)).astype(bf))
        mx.eval(cache.state)
        views.append((view, cache.nbytes))
    return views


def _time(fn_list, reps: int = 4) -> tuple[float, float]:
    """(median seconds per call of evaluating a prebuilt graph, host seconds per call to build it)."""
    import mlx.core as mx

    mx.eval([f() for f in fn_list[:2]])  # compile, warm
    evals, builds = [], []
    for _ in range(reps):
        mx.synchronize()
        t0 = time.perf_counter()
        outs = [f() for f in fn_list]
        t1 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        evals.append((time.perf_counter() - t1) / len(fn_list))
        builds.append((t1 - t0) / len(fn_list))
    evals.sort(), builds.sort()
    return evals[len(evals) // 2], builds[len(builds) // 2]


def run_timings(quick: bool, budget_s: float) -> None:
    import mlx.core as mx

    from kvcore.attention import blockwise, cuda_decode
    from kvcore.attention.config import AttentionConfig
    from kvcore.attention.rotated import in_rotated_basis

    on, off = AttentionConfig(cuda_kernel=True, cuda_min_tokens=0), AttentionConfig(cuda_kernel=False)
    t_start = time.time()
    res = {"device": mx.device_info() if hasattr(mx, "device_info") else str(mx.default_device()),
           "mlx": mx.__version__, "date": time.strftime("%Y-%m-%d"), "rows": [], "probe": probe()}
    mx.clear_cache()
    print(json.dumps(res["probe"]), flush=True)
    shapes = [(1, 4096), (1, 32768), (1, 131072), (16, 4096), (16, 32768), (16, "uneven"), (16, 131072)]
    schemes = ["affine:4", "affine:8", "turbo:k4v3", "full"]
    if quick:
        shapes, schemes = [(1, 4096), (16, 4096)], ["affine:4", "full"]
    for B, ctx in shapes:
        lengths = [1024 + i * 14336 // 15 for i in range(16)] if ctx == "uneven" else [ctx] * B
        for scheme in schemes:
            if time.time() - t_start > budget_s:
                res["rows"].append({"scheme": scheme, "rows": B, "context": ctx, "skipped": "time budget"})
                _write("kernel_timings.json", res)
                continue
            row = {"scheme": scheme, "rows": B, "context": ctx}
            try:
                per = sum(lengths) * 8 * 128 * 2 * {"affine:4": 0.5625, "affine:8": 1.0625, "turbo:k4v3": 0.4531,
                                                   "full": 2}[scheme]
                n_views = max(2, min(16, int(400e6 // per) + 1))
                views = _views(scheme, lengths, n_views)
                q = mx.random.normal((B, 32, 1, 128)).astype(mx.bfloat16)
                attend = blockwise.kv_attention if B == 1 else blockwise.packed_attention
                calls = 32 if per < 1e9 else 8
                stats = views[0][0].stats
                for label, cfg in (("kernel", on), ("portable", off)):
                    fns = [(lambda v=views[i % n_views][0], c=cfg, f=attend, q=q:
                            in_rotated_basis(f, q, v, 128**-0.5, None, c)) for i in range(calls)]
                    ev, bd = _time(fns)
                    row[label + "_us"], row[label + "_build_us"] = round(ev * 1e6, 1), round(bd * 1e6, 1)
                    row[label + "_paths"] = dict(stats.calls)
                    stats.calls.clear()
                kv = views[0][1]
                row["kv_bytes"] = kv
                row["floor_us"] = round(kv / FLOOR_BW * 1e6, 2)
                row["kernel_TBps"] = round(kv / (row["kernel_us"] * 1e-6) / 1e12, 2)
                row["speedup"] = round(row["portable_us"] / row["kernel_us"], 2)
                del views
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"[:400]
            mx.clear_cache()
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            res["elapsed_s"] = time.time() - t_start
            res["verdicts"] = cuda_decode.status()
            _write("kernel_timings.json", res)


def probe() -> dict:
    """Read bandwidth (a sum over 4 GB) and copy bandwidth (read + write) on this card."""
    import mlx.core as mx

    a = mx.random.uniform(shape=(2**30 if mx.default_device() == mx.gpu else 2**24,), dtype=mx.bfloat16)  # 2 GiB
    mx.eval(a)
    out = {}
    for label, fn, nbytes in (("read_TBps", lambda: a.sum(), a.nbytes), ("copy_TBps", lambda: a * 2, 2 * a.nbytes)):
        mx.eval(fn())
        ts = []
        for _ in range(5):
            mx.synchronize()
            t = time.perf_counter()
            mx.eval(fn())
            mx.synchronize()
            ts.append(time.perf_counter() - t)
        out[label] = round(nbytes / sorted(ts)[2] / 1e12, 2)
    return out


def merge_checks(shards: int) -> None:
    checks, e2e = [], []
    for i in range(shards + 1):
        p = OUT / f"kernel_checks_{i}.json"
        if p.exists():
            d = json.loads(p.read_text())
            checks += d["checks"]
            e2e += d.get("end_to_end", [])
            p.unlink()
        else:
            checks.append({"shard": i, "error": "no result (crashed or timed out)"})
    _write("kernel_checks.json", {"checks": checks, "end_to_end": e2e})


def table() -> None:
    for name in ("kernel_checks.json", "kernel_timings.json"):
        p = OUT / name
        if not p.exists():
            print(f"{name}: missing")
            continue
        d = json.loads(p.read_text())
        if "checks" in d:
            bad = [c for c in d["checks"] if not c.get("admitted") or c.get("seed1") or c.get("error")]
            print(f"checks: {len(d['checks'])} plans, {len(bad)} not admitted or failing a fresh check")
            for c in bad:
                print("  ", c)
            for e in d.get("end_to_end", []):
                print("  e2e", e)
        else:
            print("probe", d.get("probe"))
            print(f"{'scheme':11} {'rows':>4} {'ctx':>7} {'kernel us':>9} {'portable us':>11} {'x':>5} "
                  f"{'floor us':>8} {'TB/s':>5} {'build us':>8}")
            for r in d["rows"]:
                if "kernel_us" in r:
                    print(f"{r['scheme']:11} {r['rows']:>4} {r['context']!s:>7} {r['kernel_us']:>9} "
                          f"{r['portable_us']:>11} {r['speedup']:>5} {r['floor_us']:>8} {r['kernel_TBps']:>5} "
                          f"{r['kernel_build_us']:>8}")
                else:
                    print("  ", r)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=["check", "time", "all"], default="all")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget", type=float, default=100.0, help="seconds for the timing part")
    ap.add_argument("--shard", type=int, default=0)
    ap.add_argument("--shards", type=int, default=6, help="check processes at once (NVRTC compiles on one core each)")
    a = ap.parse_args()
    quick = ["--quick"] if a.quick else []
    if a.part == "check":
        return run_checks(a.quick, a.shard, a.shards)
    if a.part == "time":
        return run_timings(a.quick, a.budget)
    procs = [subprocess.Popen([sys.executable, __file__, "--part", "check", "--shard", str(i), "--shards", str(a.shards)]
                              + quick) for i in range(a.shards + 1)]
    t = time.time()
    for i, p in enumerate(procs):
        try:
            print(f"[check {i}] exit {p.wait(timeout=max(1, 120 - (time.time() - t)))}", flush=True)
        except subprocess.TimeoutExpired:
            p.kill()
            print(f"[check {i}] timed out", flush=True)
    merge_checks(a.shards)
    try:
        r = subprocess.run([sys.executable, __file__, "--part", "time", "--budget", str(a.budget)] + quick,
                           timeout=a.budget + 100, check=False)
        print(f"[time] exit {r.returncode}", flush=True)
    except subprocess.TimeoutExpired:
        print("[time] timed out", flush=True)
    table()


if __name__ == "__main__":
    main()
