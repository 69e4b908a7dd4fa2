"""A whole `generate` job: load, build the KV plan, generate, and summarize."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from .attention import attention_context
from .backend import backend_name, versions
from .engine import GenerateConfig, Request, SamplingConfig, generate_one, kv_summary
from .engine.prompt import encode_prompt
from .errors import MlxkvError
from .models import load_model
from .policy import KVOptions, build_caches, resolve_policy


@dataclass
class GenerateJob:
    prompts: list[str]
    model: str | None = None
    dtype: str | None = None
    system: str | None = None
    chat_template: bool = True
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    sampling: SamplingConfig = SamplingConfig()
    kv: KVOptions = field(default_factory=KVOptions)
    prefill_chunk: int = 512


@dataclass
class RunResult:
    completions: list
    summary: dict
    notices: list[str]


def run_generate(job: GenerateJob, on_text: Callable[[str], None] | None = None,
                 on_notice: Callable[[str], None] | None = None) -> RunResult:
    if job.max_tokens < 0:
        raise MlxkvError(f"--max-tokens must be >= 0, got {job.max_tokens}")
    if job.prefill_chunk < 1:
        raise MlxkvError(f"--prefill-chunk must be >= 1, got {job.prefill_chunk}")
    policy = resolve_policy(job.kv)  # bad flags fail before the model loads
    lm = load_model(job.model, job.dtype)
    notices: list[str] = []

    def note(msg: str):
        notices.append(msg)
        if on_notice:
            on_notice(msg)

    completions, caches, plan, stats = [], [], [], None
    mx.reset_peak_memory()
    for i, text in enumerate(job.prompts):
        ids = encode_prompt(lm.tokenizer, text, job.system, job.chat_template)
        if not ids:
            raise MlxkvError(f"prompt {i} is empty after tokenization")
        caches, plan = build_caches(lm.model, policy)
        if policy.compresses and policy.start >= len(ids) + job.max_tokens:
            note(f"KV stays full precision: --quantized-kv-start {policy.start} lies beyond "
                 f"prompt ({len(ids)}) + max tokens ({job.max_tokens})")
        req = Request(tuple(ids), job.max_tokens, str(i), job.stop)
        with attention_context(lm.model, required=policy.compresses) as stats:
            completions.append(generate_one(lm.model, lm.tokenizer, req, caches,
                                            GenerateConfig(job.sampling, job.prefill_chunk), on_text))
    converted = any(getattr(c, "converted", False) and c.key_codec is not None for c in caches)
    summary = {
        "type": "summary",
        "model": lm.source,
        "rows": len(completions),
        "prompt_tokens": sum(c.prompt_tokens for c in completions),
        "generated_tokens": sum(len(c.token_ids) for c in completions),
        "peak_memory_bytes": mx.get_peak_memory(),
        **kv_summary(caches),
        "kv_policy": {"source": policy.source, "codec": policy.codec.label(), "start": policy.start,
                      "max_kv_size": policy.max_kv_size},
        "converted": converted,
        "plan": [p.to_json() for p in plan],
        "backend": backend_name(),
        "attention_path": stats.path if stats else None,
        "versions": versions(),
    }
    return RunResult(completions, summary, notices)
