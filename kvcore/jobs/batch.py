"""A batched `generate` job: many prompts through the continuous-batching engine."""

from __future__ import annotations

import time
from typing import Callable

import mlx.core as mx

from ..adapter_set import install_adapters
from ..backend import backend_name, versions
from ..distributed import load_for_run
from ..engine import Engine, GenerateConfig, Request
from ..engine.memory import batch_need
from ..engine.prompt import encode_prompt
from ..engine.prompts_file import PromptSpec
from ..errors import MlxkvError
from ..models import context_notice
from ..policy import resolve_policy
from ..policy.plan import plan_layers
from ..transient import PrefillMemory
from .generate import BatchOptions, GenerateJob, RunResult, check_fits, kv_budget


def run_batch(job: GenerateJob, specs: list[PromptSpec], opts: BatchOptions,
              on_finish: Callable | None = None, on_notice: Callable[[str], None] | None = None) -> RunResult:
    job.check()
    policy = resolve_policy(job.kv)
    lm, dist = load_for_run(job.model, job.dtype, repr((job, specs, opts)), job.extra_eos)
    install_adapters(lm.model, job.adapter_path, [s.adapter for s in specs])  # per-row ones gathered
    return run_engine(lm, dist, job, specs, opts, policy, on_finish, on_notice=on_notice)


def run_engine(lm, dist, job: GenerateJob, specs: list[PromptSpec], opts: BatchOptions, policy,
               on_finish: Callable | None = None, decoder=None,
               on_notice: Callable[[str], None] | None = None) -> RunResult:
    """Requests through the Engine (plain, or with `decoder`'s speculative rounds); notices go to
    `on_notice` as they arise and into the result."""
    notices: list[str] = []

    def note(msg: str) -> None:
        notices.append(msg)
        if on_notice:
            on_notice(msg)

    requests = build_requests(lm, job, specs)
    plan, budget, need = admission(lm, policy, opts, job.prefill_chunk)
    for r in requests:  # before the context notice: a row that can never run is one line
        check_fits(need, budget, len(r.prompt_ids) + r.max_tokens, f"row {r.id}")
    context = context_notice(lm.config, [len(r.prompt_ids) + r.max_tokens for r in requests]) if lm.config else None
    if context:
        note(context)
    config = GenerateConfig(job.sampling, job.prefill_chunk, PrefillMemory(lm.model, lm.config, policy))
    engine = Engine(lm.model, lm.tokenizer, policy, opts.batch_size, config,
                    kv_budget=budget, batch_need=need, on_finish=on_finish, decoder=decoder)
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    completions = engine.run(requests)
    wall = time.perf_counter() - t0
    summary = batch_summary(lm, completions, engine, opts.batch_size, policy, plan, budget, wall,
                            engine.attention_stats.path, dist.size)
    for n in compression_notes(policy, requests, summary):
        note(n)
    return RunResult(completions, summary, notices)


def compression_notes(policy, requests: list[Request], summary: dict) -> list[str]:
    """Say plainly when a compressing policy compressed nothing (batch and speculative runs)."""
    if not policy.compresses or summary.get("compressed_tokens"):
        return []
    longest = max((len(r.prompt_ids) + r.max_tokens for r in requests), default=0)
    if policy.start >= longest:
        return [f"KV stays full precision: --quantized-kv-start {policy.start} lies beyond every row's "
                f"prompt + max tokens (longest {longest})"]
    return ["nothing was compressed: every stored token is still full precision (the conversion start "
            "was not reached, or a codec block of tokens never filled)"]


def build_requests(lm, job: GenerateJob, specs: list[PromptSpec]) -> list[Request]:
    """One Request per prompt: encoded as the job says, with its own max_tokens if it sets one."""
    requests = []
    for s in specs:
        ids = encode_prompt(lm.tokenizer, s.prompt, job.system, job.chat_template)
        if not ids:
            raise MlxkvError(f"prompt {s.id} is empty after tokenization")
        max_tokens = job.max_tokens if s.max_tokens is None else s.max_tokens
        requests.append(Request(tuple(ids), max_tokens, s.id, job.stop, adapter=s.adapter))
    return requests


def admission(lm, policy, opts: BatchOptions, chunk: int = 512) -> tuple[list, int, Callable]:
    """(per-layer plan, KV budget in bytes, the bytes a batch of final lengths needs) for the
    engine: the byte model, counting what the caches allocate."""
    plan = plan_layers(lm.model, policy)
    return plan, kv_budget(lm, opts), batch_need(lm.config, plan, lm.model, policy, chunk)


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
        **{k: peak_kv.get(k) for k in ("kv_bytes", "kv_elements", "bits_per_element", "compressed_tokens",
                                       "dense_tokens")},
        "kv_budget_bytes": budget,
        "kv_policy": {"source": policy.source, "codec": policy.label(), "start": policy.start,
                      "max_kv_size": policy.max_kv_size},
        "plan": [p.to_json() for p in plan],
        "decode_steps": sum(1 for t in engine.trace if t[0] == "decode"),
        "backend": backend_name(),
        "ranks": ranks,
        "attention_path": attention_path,
        "versions": versions(),
        **({"_decoder_stats": engine.stats.to_json()} if engine.stats is not None else {}),
    }
