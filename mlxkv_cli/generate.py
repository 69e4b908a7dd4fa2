"""`mlxkv generate`: parse -> GenerateJob -> kvcore.run_generate -> render."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from kvcore.adapters import check_adapter_folder
from kvcore.codecs import BITS
from kvcore.errors import MlxkvError
from kvcore.models import dtype_name
from kvcore.units import parse_bytes

from . import output
from .hub import fetch_model
from .options import (AdapterOpt, BatchSizeOpt, DtypeOpt, JsonOpt, KeepOpt, KvBitsOpt, KvConfigOpt, KvGroupOpt, KvOpt,
                      KvStartOpt, MaxKvBytesOpt, MaxKvOpt, MaxTokensOpt, MinPOpt, ModelOpt, OfflineOpt, PrefillChunkOpt,
                      ProfileOpt, RepetitionContextOpt, RepetitionPenaltyOpt, SeedOpt, SystemPromptOpt, TempOpt, TopKOpt,
                      TopPOpt, VerboseOpt)
from .prompts import read_prompts
from .speculative import DraftKvBitsOpt, DraftModelOpt, DraftOpt, NumDraftOpt, speculative


def generate(
    prompt_arg: Annotated[Optional[str], typer.Argument(metavar="PROMPT", help="The prompt ('-' reads stdin).")] = None,
    prompt: Annotated[Optional[list[str]], typer.Option("--prompt", "-p", help="A prompt ('-' reads stdin); repeat for a batch.")] = None,
    prompt_file: Annotated[Optional[Path], typer.Option(help="Read the prompt from a file ('-' for stdin).")] = None,
    prompts_file: Annotated[Optional[Path], typer.Option(help="Many prompts: JSON Lines {\"prompt\", \"max_tokens\", \"id\", \"adapter\"} or one prompt a line.")] = None,
    batch_size: BatchSizeOpt = 8,
    max_kv_bytes: MaxKvBytesOpt = None,
    model: ModelOpt = None,
    dtype: DtypeOpt = None,
    system_prompt: SystemPromptOpt = None,
    no_chat_template: Annotated[bool, typer.Option("--no-chat-template", help="Feed the raw prompt.")] = False,
    max_tokens: MaxTokensOpt = 256,
    temp: TempOpt = 0.0,
    top_p: TopPOpt = 1.0,
    min_p: MinPOpt = 0.0,
    seed: SeedOpt = None,
    top_k: TopKOpt = 0,
    repetition_penalty: RepetitionPenaltyOpt = 1.0,
    repetition_context_size: RepetitionContextOpt = 20,
    logprobs: Annotated[Optional[int], typer.Option(help="With --json: each token's log-probability and the top N (the model's distribution).")] = None,
    stop: Annotated[Optional[list[str]], typer.Option(help="Stop string (repeatable).")] = None,
    extra_eos_token: Annotated[Optional[list[str]], typer.Option(help="Another token that ends a row (repeatable; mlx-lm's name).")] = None,
    json_schema: Annotated[Optional[str], typer.Option(help="Constrain the output to a JSON schema (a file or inline JSON).")] = None,
    regex: Annotated[Optional[str], typer.Option(help="Constrain the output to match this regex.")] = None,
    grammar: Annotated[Optional[Path], typer.Option(help="Constrain the output to a Lark grammar (file).")] = None,
    adapter_path: AdapterOpt = None,
    kv: KvOpt = None,
    kv_bits: KvBitsOpt = None,
    kv_group_size: KvGroupOpt = None,
    quantized_kv_start: KvStartOpt = None,
    kv_config: KvConfigOpt = None,
    max_kv_size: MaxKvOpt = None,
    kv_keep: KeepOpt = None,
    profile: ProfileOpt = None,
    prefill_chunk: PrefillChunkOpt = 2048,
    save_cache: Annotated[Optional[Path], typer.Option(help="Save the KV caches after the run (prompt and generated tokens); --max-tokens 0 saves the prefilled prompt.")] = None,
    load_cache: Annotated[Optional[Path], typer.Option(help="Continue from a saved cache: -p text follows the cached tokens (raw, no template); --prompt-file is a full prompt whose cached prefix is reused.")] = None,
    chat_continue: Annotated[bool, typer.Option("--chat-continue", help="With --load-cache and -p: add the text as a new chat turn (chat template).")] = False,
    draft_model: DraftModelOpt = None,
    draft: DraftOpt = None,
    num_draft_tokens: NumDraftOpt = 4,
    draft_kv_bits: DraftKvBitsOpt = None,
    offline: OfflineOpt = False,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = False,
):
    """Generate text with a compressed KV cache."""
    from kvcore.jobs.generate import BatchOptions, GenerateJob, run_generate
    from kvcore.policy import KVOptions, resolve_policy
    from kvcore.engine import SamplingConfig
    from kvcore.store.mlx_lm_load import is_mlx_lm_cache
    from kvcore.jobs.batch import run_batch
    dtype = dtype_name(dtype)  # fp16 reads as float16, as --kv spells it
    if logprobs is not None and not json_out:
        raise MlxkvError("--logprobs needs --json (the log-probabilities go in the JSON completions)")
    if repetition_penalty != 1 and (draft is not None or draft_model is not None):
        raise MlxkvError("--repetition-penalty is not supported with speculative decoding (--draft/--draft-model)")
    check_draft_flags(draft, draft_model, draft_kv_bits)
    job = GenerateJob(
        prompts=[],
        model=model, dtype=dtype, system=system_prompt, chat_template=not no_chat_template,
        max_tokens=max_tokens, stop=tuple(stop or ()), extra_eos=tuple(extra_eos_token or ()),
        sampling=SamplingConfig(temp, top_p, min_p, seed, top_k, repetition_penalty, repetition_context_size, logprobs,
                                constraint_flag(json_schema, regex, grammar)),
        kv=KVOptions(kv_bits, kv_group_size, quantized_kv_start, str(kv_config) if kv_config else None,
                     max_kv_size, kv_keep, profile, kv),
        prefill_chunk=prefill_chunk,
        save_cache=str(save_cache) if save_cache else None, load_cache=str(load_cache) if load_cache else None,
        continue_mode="full" if prompt_file is not None else "append", chat_continue=chat_continue,
        adapter_path=str(check_adapter_folder(adapter_path)) if adapter_path else None,
    )
    # every run shape: one prompt is held to the KV budget too (batch size checked, though it runs alone)
    opts = BatchOptions(batch_size, parse_bytes(max_kv_bytes, "--max-kv-bytes") if max_kv_bytes is not None else None)
    specs = read_prompts(prompt_arg, prompt, prompt_file, prompts_file,
                         continuation=load_cache is not None and prompt_file is None)
    if (save_cache or load_cache) and (len(specs) > 1 or prompts_file is not None):
        raise MlxkvError("--save-cache and --load-cache take exactly one prompt")
    if save_cache and load_cache and is_mlx_lm_cache(load_cache):
        raise MlxkvError(f"--save-cache after --load-cache {load_cache}: an mlx-lm prompt cache holds no token ids, "
                         f"so the continued caches could not be saved with theirs")
    resolve_policy(job.kv)  # bad KV flags fail before any download
    fetch_model(model, offline)
    fetch_model(draft_model, offline)
    if draft is not None or draft_model is not None:
        return speculative(job, specs, opts, draft, draft_model, num_draft_tokens, draft_kv_bits, json_out, verbose)
    if draft_kv_bits is not None:
        raise MlxkvError("--draft-kv-bits needs --draft-model")
    if len(specs) > 1 or prompts_file is not None:
        on_finish = output.json_completion if json_out else output.labelled_completion
        result = run_batch(job, specs, opts, on_finish=on_finish, on_notice=output.notice)
        if json_out:
            output.json_line(result.summary)
        else:
            output.batch_stats_line(result.summary)
        return
    job.prompts = [specs[0].prompt]
    result = run_generate(job, on_text=None if json_out else output.stream_text, on_notice=output.notice, opts=opts)
    if json_out:
        for c in result.completions:
            output.json_line(c.to_json())
        output.json_line(result.summary)
        return
    output.stream_text("\n")
    if verbose:
        output.plan_table(result.summary["plan"])
    output.stats_line(result.completions[-1], result.summary)


def constraint_flag(json_schema: str | None, regex: str | None, grammar: Path | None) -> ConstraintSpec | None:
    from kvcore.engine.constrain import ConstraintSpec
    given = [(k, v) for k, v in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar)) if v is not None]
    if len(given) > 1:
        raise MlxkvError("give one constraint: --json-schema, --regex or --grammar")
    return ConstraintSpec.from_flag(given[0][0], str(given[0][1])) if given else None


def check_draft_flags(draft: str | None, draft_model: str | None, draft_kv_bits: int | None) -> None:
    """Speculative flags that would be accepted and ignored are one-line errors."""
    if draft not in (None, "model") and draft_model is not None:
        raise MlxkvError(f"--draft {draft} drafts without a second model: drop --draft-model (or use --draft model)")
    if draft_kv_bits is not None:
        if draft_model is None:
            raise MlxkvError("--draft-kv-bits needs --draft-model (the draft model's KV cache is what it sets)")
        if draft_kv_bits not in (0, *BITS):
            raise MlxkvError(f"--draft-kv-bits must be 0 (full precision) or one of {', '.join(map(str, BITS))}, "
                             f"got {draft_kv_bits}")
