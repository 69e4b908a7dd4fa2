"""The bench grid: KV schemes x context lengths x batch sizes, mlxkv beside mlx-lm.

Each case: seeded random-token prompts, one warm-up, N repeats; the median and the spread
(min..max) of decode tok/s; bytes a decode step reads (weights + KV) and the bandwidth that
implies, as a share of the device's measured bandwidth ceiling. A one-row mlx-lm baseline that
would run more than `baseline_factor` times mlxkv's run on the same case (and more than
`baseline_min_s`) is stopped during its warm-up and reported as skipped for time, with the
estimate (baseline_time.py).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from ..codecs import codec_names
from ..errors import MlxkvError
from ..policy import KVOptions, KVPolicy, resolve_policy
from ..policy.kv_spec import GROUPED
from .baseline_time import bounded_mlx_lm_warmup
from .measure import measure_mlx_lm, measure_mlxkv, seeded_prompts, step_weight_bytes


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
    baseline_factor: float = 10.0  # a one-row mlx-lm run may take this many times mlxkv's (0: no bound)
    baseline_min_s: float = 30.0  # ... and at least this many seconds

    def __post_init__(self):
        for name, values in (("--context", self.contexts), ("--batch", self.batches)):
            if not values or any(v < 1 for v in values):
                raise MlxkvError(f"{name} needs positive integers, got {list(values)}")
            if max(values) >= 2**31:
                raise MlxkvError(f"{name} {max(values)} is beyond what any run can hold (at most {2**31 - 1})")
        if self.gen < 2 or self.repeats < 1:
            raise MlxkvError("--gen must be >= 2 and --repeats >= 1")
        if not 0 <= self.seed < 2**64:
            raise MlxkvError(f"--seed must be an integer in [0, 2^64), got {self.seed}")
        if not (0 <= self.baseline_factor < float("inf")) or not (0 <= self.baseline_min_s < float("inf")):
            raise MlxkvError(f"--baseline-budget must be a finite number >= 0, got {self.baseline_factor}")
        if not 0 <= self.seed < 2**64:
            raise MlxkvError(f"--seed must be an integer in [0, 2^64), got {self.seed}")
        if not self.schemes:
            raise MlxkvError(f"--kv: no schemes given (accepted: {accepted_schemes()})")
        for s in self.schemes:
            scheme_policy(s)  # bad schemes fail before a model is loaded


FULL_ALIASES = ("bf16", "fp16", "fp32")  # bench's names for full precision (in the model's dtype)


def accepted_schemes() -> str:
    """The scheme forms bench and fit take: the `--kv` vocabulary plus the full-precision aliases."""
    forms = [f"{n}:N|kNvM" + ("[/gG]" if n in GROUPED else "") + "[/rR]" for n in codec_names() if n != "full"]
    return ", ".join(["full", *FULL_ALIASES, *forms, "config:FILE"])


def scheme_policy(scheme: str) -> KVPolicy:
    """A `--kv` value (kv_spec.py; bf16/fp16/fp32 read as full) -> its policy, compressing from
    the first token."""
    s = scheme.strip()
    if s in FULL_ALIASES:
        s = "full"
    name = s.partition(":")[0]
    if s != "full" and (name == "full" or name not in (*codec_names(), "config")):
        raise MlxkvError(f"unknown KV scheme {scheme!r} (accepted: {accepted_schemes()}; "
                         f"e.g. affine:4/g32, turbo:k4v3, turbo:4/r16)")
    return resolve_policy(KVOptions(kv=s, quantized_kv_start=0))


def mlx_lm_kv(policy: KVPolicy) -> tuple[int | None, int] | None:
    """(bits, group) of mlx-lm's own cache for `policy` (bits None: full precision); None where
    mlx-lm has no equivalent (other codecs, separate K/V bits, recent windows, kv_config)."""
    if not policy.active:
        return None, 64
    c = policy.codec
    if (c.name == "affine" and policy.value_codec is None and not policy.recent and policy.layer_codecs is None
            and policy.max_kv_size is None):
        return c.bits, c.group_size
    return None


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
            step_bytes = wbytes + best["kv_bytes"]  # weights read (not gathered tables) + every stored KV byte
            row["bytes_per_step"] = step_bytes
            steps_per_s = best["decode_tps_per_row"]
            row["bandwidth_gbs"] = step_bytes * steps_per_s / 1e9
            if bandwidth:
                row["bandwidth_share"] = step_bytes * steps_per_s / bandwidth
        return row


def run_grid(model, vocab: int, cfg: BenchConfig, progress: Callable[[str], None] | None = None,
             bandwidth: float | None = None) -> list[dict]:
    policies = {s: scheme_policy(s) for s in cfg.schemes}  # already checked by BenchConfig
    wbytes = step_weight_bytes(model)
    rows = []
    for context in cfg.contexts:
        for batch in cfg.batches:
            prompts = seeded_prompts(vocab, batch, context, cfg.seed)
            for scheme, policy in policies.items():
                ours_s = None  # seconds of one mlxkv run of this case
                for engine, fn in _engines(model, policy, prompts, cfg):
                    if progress:
                        progress(f"{engine} {scheme} ctx={context} batch={batch}")
                    case = Case(scheme, context, batch, engine)
                    bound = _bound(engine, policy, prompts, cfg, ours_s)
                    first = bound(model) if bound else fn()  # warm-up (and the failure, if the engine cannot run it)
                    if first.get("skipped"):
                        rows.append(_skipped(case, first["estimate_s"], ours_s, cfg))
                        continue
                    case.runs = [first] if "error" in first else [fn() for _ in range(cfg.repeats)]
                    rows.append(case.summary(wbytes, bandwidth))
                    if engine == "mlxkv":
                        walls = [r["wall_s"] for r in case.runs if "wall_s" in r]
                        ours_s = statistics.median(walls) if walls else None
                    mx.clear_cache()
    return rows


def _bound(engine: str, policy: KVPolicy, prompts, cfg: BenchConfig, ours_s: float | None):
    """The time-bounded warm-up for a one-row mlx-lm baseline, or None (no bound applies)."""
    kv = mlx_lm_kv(policy)
    if engine != "mlx-lm" or kv is None or len(prompts) != 1 or not cfg.baseline_factor or ours_s is None:
        return None
    budget = max(cfg.baseline_factor * ours_s, cfg.baseline_min_s)
    return lambda model: bounded_mlx_lm_warmup(model, kv[0], kv[1], prompts[0], cfg.gen, cfg.prefill_chunk, budget)


def _skipped(case: Case, estimate: float, ours_s: float, cfg: BenchConfig) -> dict:
    budget = max(cfg.baseline_factor * ours_s, cfg.baseline_min_s)
    return {"scheme": case.scheme, "context": case.context, "batch": case.batch, "engine": case.engine,
            "skipped": "time", "estimate_s": estimate,
            "error": f"skipped for time: mlx-lm would take ~{estimate:.0f} s a run ({cfg.repeats + 1} runs); the bound "
                     f"is {budget:.0f} s a run ({cfg.baseline_factor:g}x mlxkv's {ours_s:.1f} s, at least "
                     f"{cfg.baseline_min_s:g} s; --baseline-budget)"}


def _engines(model, policy: KVPolicy, prompts, cfg: BenchConfig) -> list[tuple[str, Callable[[], dict]]]:
    """(engine, one measured run) for mlxkv and, with baselines on, mlx-lm's equivalent cache."""
    engines = [("mlxkv", lambda: measure_mlxkv(model, policy, prompts, cfg.gen, cfg.prefill_chunk))]
    if not cfg.baseline:
        return engines
    kv = mlx_lm_kv(policy)
    if kv is None:
        return [*engines, ("mlx-lm", lambda: {"error": "not supported: mlx-lm has no cache for this scheme "
                                                       "(only full or affine, equal K/V bits)"})]
    bits, group = kv
    return [*engines, ("mlx-lm", lambda: measure_mlx_lm(model, bits, group, prompts, cfg.gen, cfg.prefill_chunk))]
