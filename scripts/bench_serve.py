#!/usr/bin/env python3
"""A bounded load test of an OpenAI-compatible server on loopback: R streamed completions from C
concurrent clients; requests/s, generated tok/s, time to first token and inter-token latency
(p50/p99), refusals. Starts `mlxkv serve` (and with --baseline, `mlx_lm.server` on the same model
and the same load, in the same run).

    python scripts/bench_serve.py [-m MODEL] [--requests 64] [--clients 16] [--prompt-words 24] [--gen 64] \
        [--serve-args "--kv-bits 4 --quantized-kv-start 0 --batch-size 16"] [--baseline] [--repeats 3] [--out f.json]
"""

from __future__ import annotations

import argparse
import http.client
import json
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvcore.backend import versions
from kvcore.models import DEFAULT_MODEL


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port: int, proc, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/v1/models")
            if c.getresponse().status == 200:
                return
        except OSError:
            time.sleep(0.2)
    raise SystemExit("server did not start")


def one(port: int, model: str, prompt: str, gen: int) -> dict:
    """One streamed completion: arrival time of every chunk with text, usage, status."""
    body = {"model": model, "prompt": prompt, "max_tokens": gen, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    try:
        c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
    except OSError as e:  # refused or reset: counted, not retried
        return {"status": type(e).__name__}
    if r.status != 200:
        r.read()
        return {"status": r.status}
    times, tokens = [], 0
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        obj = json.loads(line[5:])
        if obj.get("usage"):
            tokens = obj["usage"]["completion_tokens"]
        if obj.get("choices") and obj["choices"][0].get("text"):
            times.append(time.perf_counter() - t0)
    return {"status": 200, "times": times, "tokens": tokens, "end": time.perf_counter() - t0}


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(1000 * xs[min(len(xs) - 1, int(q * len(xs)))], 2)


def load(port: int, model: str, prompts: list[str], gen: int, clients: int) -> dict:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda p: one(port, model, p, gen), prompts))
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["status"] == 200]
    ttft = [r["times"][0] for r in ok if r["times"]]
    itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
    tokens = sum(r["tokens"] for r in ok)
    refused: dict[str, int] = {}
    for r in results:
        if r["status"] != 200:
            refused[str(r["status"])] = refused.get(str(r["status"]), 0) + 1
    return {"requests": len(prompts), "completed": len(ok), "refused": refused, "wall_s": round(wall, 3),
            "requests_per_s": round(len(ok) / wall, 2), "generated_tokens": tokens,
            "tokens_per_s": round(tokens / wall, 1), "ttft_ms_p50": pct(ttft, 0.5), "ttft_ms_p99": pct(ttft, 0.99),
            "itl_ms_p50": pct(itl, 0.5), "itl_ms_p99": pct(itl, 0.99)}


def run_server(cmd: list[str], port: int, model_id: str, prompts, gen: int, clients: int) -> dict:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(port, proc)
        load(port, model_id, prompts[: max(1, clients)], 8, clients)  # warm-up
        out = load(port, model_id, prompts, gen, clients)
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            c.request("GET", "/metrics")
            r = c.getresponse()
            text = r.read().decode()
            if r.status == 200:
                for name in ("running_rows_peak", "kv_bytes_peak", "kv_budget_bytes"):
                    line = [ln for ln in text.splitlines() if ln.startswith(f"mlxkv_{name} ")]
                    if line:
                        out[name] = float(line[0].split()[1])
        except OSError:
            pass
        return out
    finally:
        proc.terminate()
        out_rc = proc.wait(60)
        if out_rc not in (0, -15):
            print(f"server exit code {out_rc}:", proc.stderr.read(), file=sys.stderr)


def median_row(rs: list[dict]) -> dict:
    """Median of each figure over the repeats (counts summed)."""
    out = {"completed": sum(r["completed"] for r in rs), "requests": sum(r["requests"] for r in rs)}
    for k in ("requests_per_s", "tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99",
              "running_rows_peak", "kv_bytes_peak", "kv_budget_bytes"):
        xs = [r[k] for r in rs if r.get(k) is not None]
        if xs:
            out[k] = statistics.median(xs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--prompt-words", type=int, default=24, help="seeded random words per prompt")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--serve-args", default="--batch-size 16")
    ap.add_argument("--baseline", action="store_true", help="also mlx_lm.server, same model and load")
    ap.add_argument("--repeats", type=int, default=3, help="runs per server, alternating (medians reported)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rng = random.Random(0)
    words = ("once upon a time there was little girl boy dog cat who liked to play with big red ball in the park "
             "sun tree house mom dad happy sad friend went saw").split()
    prompts = [" ".join(rng.choice(words) for _ in range(a.prompt_words)) for _ in range(a.requests)]
    runs: dict[str, list[dict]] = {}
    for _ in range(a.repeats):  # the servers alternate, so a busy machine weighs on both alike
        port = free_port()
        cmd = [sys.executable, "-m", "mlxkv_cli", "serve", "--port", str(port), *a.serve_args.split()]
        if a.model:
            cmd += ["-m", a.model]
        model_id = a.model or "embedded:stories260K"
        model_id = Path(model_id).name if Path(model_id).exists() else model_id
        runs.setdefault("mlxkv serve " + a.serve_args, []).append(run_server(cmd, port, model_id, prompts, a.gen,
                                                                              a.clients))
        if a.baseline:
            path = a.model or str(DEFAULT_MODEL)
            port = free_port()
            cmd = [sys.executable, "-m", "mlx_lm.server", "--model", path, "--port", str(port)]
            runs.setdefault("mlx_lm.server", []).append(run_server(cmd, port, "default_model", prompts, a.gen,
                                                                   a.clients))
    rows = [{"server": name, **median_row(rs), "runs": rs} for name, rs in runs.items()]
    doc = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
           "cpus": __import__("os").cpu_count(), "versions": versions(),
           "load": {"requests": a.requests, "clients": a.clients, "prompt_words": a.prompt_words, "gen": a.gen,
                    "repeats": a.repeats},
           "rows": rows}
    text = json.dumps(doc, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
