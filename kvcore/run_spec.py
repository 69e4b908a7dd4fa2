"""A speculative `generate` job: one or many prompts, a draft provider, the SpecEngine."""

from __future__ import annotations

import time
from contextlib import ExitStack
from typing import Callable

import mlx.core as mx

from .attention import attention_context
from .engine import GenerateConfig
from .engine.prompts_file import PromptSpec
from .errors import MlxkvError
from .models import load_model
from .policy import resolve_policy
from .run import GenerateJob, RunResult
from .run_batch import BatchOptions, admission, batch_summary, build_requests
from .spec import SpecEngine, SpecOptions, draft_for_job


def run_speculative(job: GenerateJob, specs: list[PromptSpec], opts: BatchOptions, spec: SpecOptions,
                    on_finish: Callable | None = None) -> RunResult:
    if job.max_tokens < 0:
        raise MlxkvError(f"--max-tokens must be >= 0, got {job.max_tokens}")
    if job.save_cache or job.load_cache:
        raise MlxkvError("--save-cache and --load-cache are not supported with speculative decoding")
    policy = resolve_policy(job.kv)
    lm = load_model(job.model, job.dtype)
    draft = draft_for_job(spec, job, lm)  # a mismatched draft fails before any work
    requests = build_requests(lm, job, specs)
    plan, budget, row_bytes = admission(lm, policy, opts)
    engine = SpecEngine(
        lm.model, lm.tokenizer, policy, draft, spec.num_draft_tokens, opts.batch_size,
        GenerateConfig(job.sampling, job.prefill_chunk), kv_budget=budget, row_bytes=row_bytes,
        on_finish=on_finish,
    )
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    with ExitStack() as stack:
        for m in draft.models:  # outermost: the target's context (innermost) counts every call
            stack.enter_context(attention_context(m))
        stats = stack.enter_context(attention_context(lm.model))
        completions = engine.run(requests)
    wall = time.perf_counter() - t0
    summary = batch_summary(lm, completions, engine, opts.batch_size, policy, plan, budget, wall, stats.path, 1)
    summary["speculative"] = {**draft.describe(), **engine.stats.to_json()}
    return RunResult(completions, summary, [])
