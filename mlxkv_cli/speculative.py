"""`generate --draft-model/--draft`: speculative decoding, one prompt or many."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from . import output

DraftModelOpt = Annotated[Optional[str], typer.Option(help="Speculative decoding with this draft model (same tokenizer as the target): a folder, .gguf or cached repo id.")]
DRAFTS = ("model", "prompt-lookup")  # kvcore.speculative.draft_names(), written out: --help imports no engine
DraftOpt = Annotated[Optional[str], typer.Option(help=f"Draft provider: {', '.join(DRAFTS)} (prompt-lookup needs no second model).")]
NumDraftOpt = Annotated[int, typer.Option(help="Draft tokens proposed per row and round.")]
DraftKvBitsOpt = Annotated[Optional[int], typer.Option(help="KV bits of the draft model's cache (0 = full precision; default: the target's KV settings).")]


def speculative(job: GenerateJob, specs: list, opts: BatchOptions, draft: str | None, draft_model: str | None,
                num_draft_tokens: int, draft_kv_bits: int | None, json_out: bool, verbose: bool) -> None:
    from kvcore.speculative import SpecOptions
    from kvcore.jobs.speculative import run_speculative
    spec = SpecOptions(draft or "model", draft_model, num_draft_tokens, draft_kv_bits)
    single = len(specs) == 1
    if json_out:
        on_finish = output.json_completion
    else:
        on_finish = (lambda c: output.stream_text(c.text + "\n")) if single else output.labelled_completion
    result = run_speculative(job, specs, opts, spec, on_finish=on_finish, on_notice=output.notice)
    s = result.summary
    if json_out:
        output.json_line(s)
        return
    if verbose:
        output.plan_table(s["plan"])
    if single:
        output.stats_line(result.completions[0], s)
    else:
        output.batch_stats_line(s)
    output.spec_stats_line(s["speculative"])
