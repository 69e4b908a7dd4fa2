"""A speculative `generate` job: the Engine composed with a speculative round (one load path
with plain runs)."""

from __future__ import annotations

from typing import Callable

from ..adapter_set import install_adapters
from ..distributed import load_for_run
from ..engine.prompts_file import PromptSpec
from ..errors import MlxkvError
from ..policy import resolve_policy
from ..speculative import SpecOptions, draft_for_job
from ..speculative.engine import SpeculativeDecode
from .batch import BatchOptions, run_engine
from .generate import GenerateJob, RunResult


def run_speculative(job: GenerateJob, specs: list[PromptSpec], opts: BatchOptions, spec: SpecOptions,
                    on_finish: Callable | None = None, on_notice: Callable[[str], None] | None = None) -> RunResult:
    job.check()
    if job.save_cache or job.load_cache:
        raise MlxkvError("--save-cache and --load-cache are not supported with speculative decoding")
    policy = resolve_policy(job.kv)
    lm, dist = load_for_run(job.model, job.dtype, repr((job, specs, opts, spec)), job.extra_eos)
    install_adapters(lm.model, job.adapter_path, [s.adapter for s in specs])  # the target's; a draft runs without
    if dist.size > 1:
        raise MlxkvError(f"speculative decoding runs on one rank; this launch has {dist.size} "
                         "(drop --draft or run without the launcher)")
    draft = draft_for_job(spec, job, lm)  # a mismatched draft fails before any work
    result = run_engine(lm, dist, job, specs, opts, policy, on_finish, SpeculativeDecode(draft, spec.num_draft_tokens),
                        on_notice)
    result.summary["speculative"] = {**draft.describe(), **result.summary.pop("_decoder_stats", {})}
    return result
