"""Bound mlx-lm's baseline runs by time: a warm-up that stops once it is sure to run too long.

mlx-lm's quantized rows at 4k+ tokens on a CPU run for hours (its quantized attention reads
the cache through `quantized_matmul`, chunk after chunk). The warm-up of a one-row baseline
runs mlx-lm's own `generate_step` and, after every prefill chunk and decoded token, projects
the whole run from what it has timed; past the budget (a multiple of mlxkv's own run on the
same case) it stops, and the row says it was skipped for time, with the estimate.

Projection: prefill chunk k costs its predecessor plus the growth seen from k-1 to k
(attention grows with the cached tokens); decoding costs the last token's time per token.
"""

from __future__ import annotations

import importlib
import math
import time

import mlx.core as mx

from ..backend import failure


class _TooSlow(Exception):
    def __init__(self, estimate: float):
        self.estimate = estimate


def project_prefill(chunk_times: list[float], processed: int, total: int, chunk: int) -> float:
    """Seconds the rest of a prefill will take: `chunk_times` of the chunks done so far (the last
    one includes everything since the previous), `processed` of `total` tokens (the last token is
    fed by the first decode step, as mlx-lm does)."""
    left = max(0, total - 1 - processed)
    if not left or not chunk_times:
        return 0.0
    n = math.ceil(left / chunk)
    last = chunk_times[-1]
    growth = max(0.0, last - chunk_times[-2]) if len(chunk_times) > 1 else 0.0
    return n * last + growth * n * (n + 1) / 2


def bounded_mlx_lm_warmup(model, kv_bits: int | None, group: int, prompt: list[int], gen: int, chunk: int,
                          budget_s: float) -> dict:
    """Warm mlx-lm up on one row as `measure_mlx_lm` runs it; {} when the run fits `budget_s`,
    {"skipped": ..., "estimate_s": ...} as soon as its projection exceeds it, or mlx-lm's error."""
    g = importlib.import_module("mlx_lm.generate")
    marks: list[float] = []
    t0 = time.perf_counter()

    def on_prefill(processed: int, total: int):
        now = time.perf_counter()
        if 0 < processed < total:
            marks.append(now)
            times = [b - a for a, b in zip([t0, *marks], marks)]
            estimate = now - t0 + project_prefill(times, processed, total, chunk)
            if estimate > budget_s:
                raise _TooSlow(estimate)

    kw = {"kv_bits": kv_bits, "kv_group_size": group, "quantized_kv_start": 0} if kv_bits else {}
    steps = g.generate_step(mx.array(prompt), model, max_tokens=gen, prefill_step_size=chunk,
                            prompt_progress_callback=on_prefill, **kw)
    try:
        last = time.perf_counter()
        for n, _ in enumerate(steps, 1):
            now = time.perf_counter()
            estimate = now - t0 + (now - last) * (gen - n)
            last = now
            if n > 1 and estimate > budget_s:
                raise _TooSlow(estimate)
        mx.synchronize()
    except _TooSlow as e:
        return {"skipped": "time", "estimate_s": round(e.estimate, 3)}
    except Exception as e:  # the baseline's failure is a result, as measure_mlx_lm reports it
        return {"error": failure(e)}
    finally:
        steps.close()
        mx.clear_cache()
    return {}
