"""The bench grid: KV schemes x context lengths x batch sizes, mlxkv beside mlx-lm.

Each case: seeded random-token prompts, one warm-up, N repeats; the median and the spread
(min..max) of decode tok/s; bytes a decode step reads (weights + KV) and the bandwidth that
implies, as a share of the device's measured copy bandwidth.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from ..codecs import CodecSpec
from ..errors import MlxkvError
from ..policy import KVPolicy
from .measure import measure_mlx_lm, measure_mlxkv, seeded_prompts, weight_bytes


@dataclass(frozen=True)
class BenchConfig:
    schemes: tuple[str, ...] = ("full", "affine:8", "affine:4")
    contexts: tuple[int, ...] = (512,)
    batches: tuple[int, ...] = (1,)
    gen: int = 64
    repeats: int = 3
    seed: int = 0
    baseline: bool = True
    prefill_chunk: int = 2048

    def __post_init__(self):
        for name, values in (("--context", self.contexts), ("--batch", self.batches)):
            if not values or any(v < 1 for v in values):
                raise MlxkvError(f"{name} needs positive integers, got {list(values)}")
        if self.gen < 2 or self.repeats < 1:
            raise MlxkvError("--gen must be >= 2 and --repeats >= 1")


def scheme_policy(scheme: str) -> KVPolicy:
    """'full' | 'affine:BITS[/gGROUP]' -> the policy (quantized from the first token)."""
    if scheme in ("full", "bf16", "fp16", "fp32"):  # full precision (in the model's dtype)
        return KVPolicy()
    name, _, rest = scheme.partition(":")
    bits, _, group = rest.partition("/g")
    if name != "affine" or not bits.isdigit() or (group and not group.isdigit()):
        raise MlxkvError(f"unknown KV scheme {scheme!r} (use full, affine:BITS or affine:BITS/gGROUP)")
    return KVPolicy(CodecSpec("affine", int(bits), int(group or 64)), start=0)


@dataclass
class Case:
    scheme: str
    context: int
    batch: int
    engine: str  # "mlxkv" | "mlx-lm"
    runs: list = field(default_factory=list)

    def summary(self, wbytes: int, bandwidth: float | None) -> dict:
        ok = [r for r in self.runs if "error" not in r]
        row = {"scheme": self.scheme, "context": self.context, "batch": self.batch, "engine": self.engine}
        if not ok:
            return {**row, "error": self.runs[0]["error"] if self.runs else "not run"}
        tps = [r["decode_tps"] for r in ok]
        med = statistics.median_low(tps)
        best = next(r for r in ok if r["decode_tps"] == med)
        row.update({k: v for k, v in best.items() if k not in ("decode_tps",)})
        row.update({"decode_tps": med, "decode_tps_min": min(tps), "decode_tps_max": max(tps), "repeats": len(ok)})
        if best.get("kv_bytes") is not None:
            step_bytes = wbytes + best["kv_bytes"]  # every weight and every stored KV byte, each step
            row["bytes_per_step"] = step_bytes
            steps_per_s = best["decode_tps_per_row"]
            row["bandwidth_gbs"] = step_bytes * steps_per_s / 1e9
            if bandwidth:
                row["bandwidth_share"] = step_bytes * steps_per_s / bandwidth
        return row


def run_grid(model, vocab: int, cfg: BenchConfig, progress: Callable[[str], None] | None = None,
             bandwidth: float | None = None) -> list[dict]:
    policies = {s: scheme_policy(s) for s in cfg.schemes}  # bad schemes fail before any work
    wbytes = weight_bytes(model)
    rows = []
    for context in cfg.contexts:
        for batch in cfg.batches:
            prompts = seeded_prompts(vocab, batch, context, cfg.seed)
            for scheme, policy in policies.items():
                engines = [("mlxkv", lambda: measure_mlxkv(model, policy, prompts, cfg.gen, cfg.prefill_chunk))]
                if cfg.baseline:
                    spec = policy.codec
                    engines.append(("mlx-lm", lambda: measure_mlx_lm(model, spec.bits, spec.group_size or 64,
                                                                      prompts, cfg.gen, cfg.prefill_chunk)))
                for engine, fn in engines:
                    if progress:
                        progress(f"{engine} {scheme} ctx={context} batch={batch}")
                    case = Case(scheme, context, batch, engine)
                    first = fn()  # warm-up (and the failure, if the engine cannot run this case)
                    case.runs = [first] if "error" in first else [fn() for _ in range(cfg.repeats)]
                    rows.append(case.summary(wbytes, bandwidth))
                    mx.clear_cache()
    return rows
