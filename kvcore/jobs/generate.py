"""A whole `generate` job: load, build the KV plan, generate, and summarize."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from ..adapters import apply_adapter
from ..attention.hook import attention_stats, bind
from ..backend import backend_name, versions
from ..distributed import launched, load_for_run, on_every_rank
from ..engine import GenerateConfig, Request, SamplingConfig, generate_one, kv_summary
from ..engine.chat import continue_chat, conversation, held_ids, save_conversation
from ..engine.forward import DEFAULT_PREFILL_CHUNK, cache_offset
from ..engine.memory import batch_need, default_kv_budget, model_bytes
from ..engine.prompt import encode_continuation, encode_prompt, has_chat_template
from ..errors import MlxkvError
from ..models import context_notice
from ..policy import KVOptions, build_caches, resolve_policy
from ..policy.plan import plan_layers
from ..store import Sharding, rank_path
from ..store.atomic import check_target
from ..transient import PrefillMemory
from ..units import format_bytes
from .resume import open_for_model, run_sharding, save_after_run, start_from_cache


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
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # 2048, as mlx-lm (kvcore.transient plans smaller ones for a budget)
    save_cache: str | None = None  # save the caches after the run (prompt + generated tokens)
    load_cache: str | None = None  # continue from a saved cache
    continue_mode: str = "append"  # with load_cache: "append" the prompt as raw tokens | it is the "full" prompt
    chat_continue: bool = False  # "append" through the chat template, as a new user turn
    extra_eos: tuple[str, ...] = ()  # more tokens that end a row (mlx-lm's --extra-eos-token)
    adapter_path: str | None = None  # an mlx-lm LoRA adapter folder, loaded into the model

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """What every run shape (one prompt, a batch, speculative) refuses alike, before any work."""
        if self.max_tokens < 0:
            raise MlxkvError(f"--max-tokens must be >= 0, got {self.max_tokens}")
        if self.prefill_chunk < 1:
            raise MlxkvError(f"--prefill-chunk must be >= 1, got {self.prefill_chunk}")
        if any(not s for s in self.stop):
            raise MlxkvError("--stop '' is an empty stop string (it would match before any text): give the text to stop at")


@dataclass
class BatchOptions:
    batch_size: int = 8
    max_kv_bytes: int | None = None  # None: the device's default budget

    def __post_init__(self):
        if self.batch_size < 1:
            raise MlxkvError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.max_kv_bytes is not None and self.max_kv_bytes < 0:
            raise MlxkvError(f"--max-kv-bytes must be >= 0, got {self.max_kv_bytes}")


def kv_budget(lm, opts: BatchOptions) -> int:
    """The KV budget rows are admitted under: --max-kv-bytes, else the device's default."""
    return opts.max_kv_bytes if opts.max_kv_bytes is not None else default_kv_budget(model_bytes(lm.model))


def check_fits(need: Callable[[list[int]], int], budget: int, tokens: int, what: str,
               budget_name: str = "the budget (--max-kv-bytes)") -> None:
    """A row whose KV at its final size (`tokens`) exceeds the budget can never run: one line, before
    any work (the Scheduler's rule, for one prompt as for a batch)."""
    n = need([tokens])
    if n > budget:
        raise MlxkvError(f"{what} can never fit: its KV needs {format_bytes(n)} at its final size ({tokens} tokens), "
                         f"{budget_name} is {format_bytes(budget)}")


def check_row_fits(lm, policy, tokens: int, what: str, opts: BatchOptions | None = None,
                   chunk: int = DEFAULT_PREFILL_CHUNK, plan: list | None = None,
                   budget_name: str = "the budget (--max-kv-bytes)") -> None:
    """`check_fits` for one row of `tokens` under `policy` (its per-layer `plan` if built already)."""
    if lm.config:
        plan = plan if plan is not None else plan_layers(lm.model, policy)
        check_fits(batch_need(lm.config, plan, lm.model, policy, chunk), kv_budget(lm, opts or BatchOptions()),
                   tokens, what, budget_name)


def _open_files(job: GenerateJob, lm, layout: Sharding):
    """Check this rank's --save-cache target and open its --load-cache file."""
    if job.save_cache:
        check_target(rank_path(job.save_cache, layout.rank, layout.ranks))
    return open_for_model(job.load_cache, lm, layout) if job.load_cache else None


def _saved(path: str, size: int, layout: Sharding) -> str:
    if layout.single:
        return f"saved the KV cache to {path} ({format_bytes(size)})"
    names = [str(path)] + [rank_path(path, r, layout.ranks).name for r in range(1, layout.ranks)]
    return (f"saved the KV cache as {layout.ranks} rank files, each on its rank's machine: {', '.join(names)} "
            f"(this rank's: {format_bytes(size)})")


@dataclass
class RunResult:
    completions: list
    summary: dict
    notices: list[str]


def run_generate(job: GenerateJob, on_text: Callable[[str], None] | None = None,
                 on_notice: Callable[[str], None] | None = None, opts: BatchOptions | None = None) -> RunResult:
    """Each prompt alone (of `opts`, only the KV budget applies)."""
    job.check()
    policy = resolve_policy(job.kv)  # bad flags fail before the model loads
    if (job.save_cache or job.load_cache) and len(job.prompts) != 1:
        raise MlxkvError("--save-cache and --load-cache take exactly one prompt")
    if job.chat_continue and not (job.load_cache and job.continue_mode == "append"):
        raise MlxkvError("--chat-continue adds -p text after a loaded cache: it needs --load-cache, "
                         "not --prompt-file")
    if job.save_cache and not launched():
        check_target(job.save_cache)  # before the model loads (under a launcher: every rank, below)
    lm, dist = load_for_run(job.model, job.dtype, repr(job), job.extra_eos)
    if job.adapter_path:
        apply_adapter(lm.model, job.adapter_path)
    layout = run_sharding(lm, dist.size, dist.rank)
    cached = None
    if job.save_cache or job.load_cache:  # checked before any work
        cached = on_every_rank(dist, "opening the cache files", lambda: _open_files(job, lm, layout),
                               key=lambda cf: cf.set_key() if cf else "",
                               differ="rank {rank}'s cache file holds other tokens or KV settings than rank 0's "
                                      "(files of different saves?)")
    notices: list[str] = []

    def note(msg: str):
        notices.append(msg)
        if on_notice:
            on_notice(msg)

    completions, caches, plan = [], [], []
    mx.reset_peak_memory()
    kv_policy = {"source": policy.source, "codec": policy.label(), "start": policy.start,
                 "max_kv_size": policy.max_kv_size}
    for i, text in enumerate(job.prompts):
        messages = None  # the conversation the context renders, when it is one (saved beside --save-cache)
        if cached is not None and job.continue_mode == "append" and job.chat_continue:
            ids, messages = continue_chat(lm.tokenizer, job.load_cache, cached.prefix_ids, text, job.system,
                                          use_file=layout.single)
        elif cached is not None and job.continue_mode == "append":
            ids = cached.prefix_ids + encode_continuation(lm.tokenizer, text)
        else:
            ids = encode_prompt(lm.tokenizer, text, job.system, job.chat_template)
            if job.chat_template and has_chat_template(lm.tokenizer):
                messages = conversation([{"role": "user", "content": text}], job.system)
        if not ids:
            raise MlxkvError(f"prompt {i} is empty after tokenization")
        feed, compresses = ids, policy.compresses
        if cached is not None:
            asked = policy if any(v is not None for v in vars(job.kv).values()) else None
            start = start_from_cache(cached, ids, lm.model, asked, note)
            caches, plan, feed, compresses, kv_policy = (start.caches, start.plan, start.prefill,
                                                         start.compresses, start.kv_policy)
        else:
            caches, plan = build_caches(lm.model, policy)
        check_row_fits(lm, policy, len(ids) + job.max_tokens,  # refused before any work, as a batch's rows are
                       f"the prompt ({len(ids)} tokens) + --max-tokens {job.max_tokens}", opts, job.prefill_chunk, plan)
        if cached is None and policy.compresses and policy.start >= len(ids) + job.max_tokens:
            note(f"KV stays full precision: --quantized-kv-start {policy.start} lies beyond "
                 f"prompt ({len(ids)}) + max tokens ({job.max_tokens})")
        reused = len(ids) - len(feed) if cached is not None else 0
        context = context_notice(lm.config, [reused + len(feed) + job.max_tokens]) if lm.config else None
        if context:
            note(context)
        req = Request(tuple(feed), job.max_tokens, str(i), job.stop)
        if compresses:
            bind(lm.model)  # loaded caches: make sure the model attends through kvcore
        memory = PrefillMemory(lm.model, lm.config, policy)  # a long prompt is prefilled within the memory model
        completions.append(generate_one(lm.model, lm.tokenizer, req, caches,
                                        GenerateConfig(job.sampling, job.prefill_chunk, memory), on_text))
        if job.save_cache:
            done = completions[-1]
            _, size = on_every_rank(dist, "saving the cache files",
                                    lambda: save_after_run(job.save_cache, lm, caches, ids, done, layout))
            note(_saved(job.save_cache, size, layout))
            if messages is not None and layout.single:
                save_conversation(job.save_cache, messages + [{"role": "assistant", "content": done.text}],
                                  held_ids(ids, done, cache_offset(caches)))
    kv = kv_summary(caches)
    converted = kv["compressed_tokens"] > 0  # the codec really holds tokens, not just a flag
    if compresses and not converted and completions and not any(n.startswith("KV stays") for n in notices):
        note("nothing was compressed: every stored token is still full precision (the conversion "
             "start was not reached, or a codec block of tokens never filled)")
    summary = {
        "type": "summary",
        "model": lm.source,
        "rows": len(completions),
        "prompt_tokens": sum(c.prompt_tokens for c in completions),
        "generated_tokens": sum(len(c.token_ids) for c in completions),
        "peak_memory_bytes": mx.get_peak_memory(),
        **kv,
        "kv_policy": kv_policy,
        "converted": converted,
        "plan": [p.to_json() for p in plan],
        "backend": backend_name(),
        "ranks": dist.size,
        "attention_path": attention_stats(caches).path,
        "versions": versions(),
    }
    return RunResult(completions, summary, notices)
