"""A batched `generate` job: many prompts through the continuous-batching engine."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
from mlx.utils import tree_flatten

from .attention import attention_context
from .backend import backend_name, versions
from .engine import GenerateConfig, Request
from .engine.batch import BatchEngine
from .engine.memory import default_kv_budget, row_kv_bytes
from .engine.prompt import encode_prompt
from .engine.prompts_file import PromptSpec
from .errors import MlxkvError
from .distributed import load_for_run
from .policy import build_caches, resolve_policy
from .run import GenerateJob, RunResult


@dataclass
class BatchOptions:
    batch_size: int = 8
    max_kv_bytes: int | None = None  # None: the device's default budget


def run_batch(job: GenerateJob, specs: list[PromptSpec], opts: BatchOptions,
              on_finish: Callable | None = None, on_notice: Callable[[str], None] | None = None) -> RunResult:
    if job.max_tokens < 0:
        raise MlxkvError(f"--max-tokens must be >= 0, got {job.max_tokens}")
    policy = resolve_policy(job.kv)
    lm, dist = load_for_run(job.model, job.dtype, repr((job, specs, opts)))
    requests = build_requests(lm, job, specs)
    plan, budget, row_bytes = admission(lm, policy, opts)
    engine = BatchEngine(
        lm.model, lm.tokenizer, policy, opts.batch_size, GenerateConfig(job.sampling, job.prefill_chunk),
        kv_budget=budget, row_bytes=row_bytes,
        on_finish=on_finish,
    )
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    with attention_context(lm.model, required=policy.compresses) as stats:
        completions = engine.run(requests)
    wall = time.perf_counter() - t0
    summary = batch_summary(lm, completions, engine, opts.batch_size, policy, plan, budget, wall, stats.path,
                            dist.size)
    return RunResult(completions, summary, [])


def build_requests(lm, job: GenerateJob, specs: list[PromptSpec]) -> list[Request]:
    """One Request per prompt: encoded as the job says, with its own max_tokens if it sets one."""
    requests = []
    for s in specs:
        ids = encode_prompt(lm.tokenizer, s.prompt, job.system, job.chat_template)
        if not ids:
            raise MlxkvError(f"prompt {s.id} is empty after tokenization")
        max_tokens = job.max_tokens if s.max_tokens is None else s.max_tokens
        requests.append(Request(tuple(ids), max_tokens, s.id, job.stop))
    return requests


def admission(lm, policy, opts: BatchOptions) -> tuple[list, int, Callable]:
    """(per-layer plan, KV budget in bytes, a request's KV bytes at its longest) for the engine."""
    _, plan = build_caches(lm.model, policy)
    dtype_size = next((p.dtype.size for _, p in tree_flatten(lm.model.parameters())
                       if mx.issubdtype(p.dtype, mx.floating)), 2)
    budget = opts.max_kv_bytes if opts.max_kv_bytes is not None else default_kv_budget()
    return plan, budget, lambda r: row_kv_bytes(lm.config, plan, len(r.prompt_ids) + r.max_tokens, dtype_size)


def batch_summary(lm, completions, engine, batch_size: int, policy, plan, budget: int, wall: float,
                  attention_path: str, ranks: int) -> dict:
    """The JSON summary of a run through the batching engine (plain or speculative)."""
    generated = sum(len(c.token_ids) for c in completions)
    prompt = sum(c.prompt_tokens for c in completions)
    peak_kv = engine.peak_kv or {"kv_bytes": 0, "kv_elements": 0, "bits_per_element": None}
    return {
        "type": "summary",
        "model": lm.source,
        "rows": len(completions),
        "batch_size": batch_size,
        "prompt_tokens": prompt,
        "generated_tokens": generated,
        "total_tokens": generated + prompt,
        "wall_time_s": round(wall, 4),
        "aggregate_tps": round(generated / wall, 2) if wall else 0.0,
        "decode_tps": round(engine.decoded / engine.decode_time, 2) if engine.decode_time else 0.0,
        "peak_memory_bytes": mx.get_peak_memory(),
        **{k: peak_kv.get(k) for k in ("kv_bytes", "kv_elements", "bits_per_element")},
        "kv_budget_bytes": budget,
        "kv_policy": {"source": policy.source, "codec": policy.label(), "start": policy.start,
                      "max_kv_size": policy.max_kv_size},
        "plan": [p.to_json() for p in plan],
        "decode_steps": sum(1 for t in engine.trace if t[0] == "decode"),
        "backend": backend_name(),
        "ranks": ranks,
        "attention_path": attention_path,
        "versions": versions(),
    }
