"""`mlxkv chat`: a terminal chat whose (compressed) KV cache persists across turns.

Lines from stdin are user turns; answers stream to stdout. Commands: /save FILE, /load FILE,
/reset, /stats, /quit (or end of input). Ctrl-C stops the current answer, not the session.
"""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from kvcore.adapters import apply_adapter, check_adapter_folder
from kvcore.errors import MlxkvError, first_line
from kvcore.models import dtype_name, load_model
from kvcore.units import format_bytes

from . import output
from .hub import fetch_model
from .options import (AdapterOpt, DtypeOpt, KeepOpt, KvBitsOpt, KvConfigOpt, KvGroupOpt, KvOpt, KvStartOpt, MaxKvOpt,
                      MaxTokensOpt, MinPOpt, ModelOpt, OfflineOpt, PrefillChunkOpt, ProfileOpt, RepetitionPenaltyOpt, SeedOpt,
                      SystemPromptOpt, TempOpt, TopKOpt, TopPOpt, reworded)

HELP = "/save FILE, /load FILE, /reset, /stats, /quit; Ctrl-C stops an answer, end of input (Ctrl-D) quits"
ConversationSystemOpt = reworded(SystemPromptOpt, "System message of the conversation.")
AnswerTokensOpt = reworded(MaxTokensOpt, "Most tokens per answer.")
ChatRepetitionOpt = reworded(RepetitionPenaltyOpt, "Penalty for recently seen tokens (1 = off).")


def chat(
    model: ModelOpt = None,
    dtype: DtypeOpt = None,
    system_prompt: ConversationSystemOpt = None,
    max_tokens: AnswerTokensOpt = 512,
    temp: TempOpt = 0.0,
    top_p: TopPOpt = 1.0,
    min_p: MinPOpt = 0.0,
    top_k: TopKOpt = 0,
    repetition_penalty: ChatRepetitionOpt = 1.0,
    seed: SeedOpt = None,
    kv: KvOpt = None,
    kv_bits: KvBitsOpt = None,
    kv_group_size: KvGroupOpt = None,
    quantized_kv_start: KvStartOpt = None,
    kv_config: KvConfigOpt = None,
    max_kv_size: MaxKvOpt = None,
    kv_keep: KeepOpt = None,
    profile: ProfileOpt = None,
    prefill_chunk: PrefillChunkOpt = 2048,
    load_cache: Annotated[Optional[str], typer.Option(help="Start from a saved cache (as /load FILE).")] = None,
    adapter_path: AdapterOpt = None,
    offline: OfflineOpt = False,
):
    """Chat in the terminal; the KV cache persists across turns (only each new turn is prefilled)."""
    from kvcore.chat_session import ChatSession
    from kvcore.policy import KVOptions, resolve_policy
    from kvcore.engine import SamplingConfig
    from kvcore.jobs.generate import check_row_fits
    sampling = SamplingConfig(temp, top_p, min_p, seed, top_k, repetition_penalty)
    if prefill_chunk < 1:
        raise MlxkvError(f"--prefill-chunk must be >= 1, got {prefill_chunk}")
    policy = resolve_policy(KVOptions(kv_bits, kv_group_size, quantized_kv_start, str(kv_config) if kv_config else None,
                                      max_kv_size, kv_keep, profile, kv))
    fetch_model(model, offline)
    if adapter_path:
        check_adapter_folder(adapter_path)
    lm = load_model(model, dtype_name(dtype))
    if adapter_path:
        apply_adapter(lm.model, adapter_path)
    check_row_fits(lm, policy, max_tokens, f"an answer of --max-tokens {max_tokens}", chunk=prefill_chunk,
                   budget_name="the KV budget (the GPU's working set or half of RAM, less the weights)")
    session = ChatSession(lm, policy, sampling, system_prompt, max_tokens, prefill_chunk, on_notice=output.notice)
    if load_cache:
        session.load(load_cache)
    output.err.print(f"mlxkv chat with {lm.source} (KV {policy.label()}): {HELP}")
    repl(session)


def repl(session: ChatSession) -> None:
    while True:
        try:
            output.err.print(">> ", end="")
            line = sys.stdin.readline()
        except KeyboardInterrupt:
            output.err.print("")
            continue
        if not line:
            return
        line = line.rstrip("\n")
        if not line.strip():
            continue
        try:
            if line.startswith("/"):
                if command(session, line) == "quit":
                    return
            else:
                answer(session, line)
        except MlxkvError as e:  # a bad /load file or the like: the session goes on
            output.err.print(f"error: {first_line(e, None)}")
        except KeyboardInterrupt:  # Ctrl-C outside an answer (a command, the prompt's prefill)
            output.stream_text("\n")
            output.notice("stopped (Ctrl-C)")


def answer(session: ChatSession, text: str) -> None:
    turn = session.ask(text, on_text=output.stream_text)
    output.stream_text("\n")
    if turn.completion.finish_reason == "abort":
        output.notice("stopped (Ctrl-C): the answer so far stays in the conversation")
    elif turn.completion.finish_reason == "length":
        output.notice(f"the answer reached --max-tokens ({session.max_tokens})")


def command(session: ChatSession, line: str) -> str | None:
    name, _, arg = line.partition(" ")
    arg = arg.strip()
    if name in ("/quit", "/exit"):
        return "quit"
    if name in ("/save", "/load") and not arg:
        raise MlxkvError(f"{name} needs a file name: {name} FILE")
    if name == "/save":
        size = session.save(arg)
        output.notice(f"saved the conversation's KV cache to {arg} ({format_bytes(size)})")
    elif name == "/load":
        session.load(arg)
        output.notice(f"loaded {arg}: {len(session.ids)} tokens")
    elif name == "/reset":
        session.reset()
        output.notice("the conversation and its KV cache are cleared")
    elif name == "/stats":
        output.stream_text(stats_line(session) + "\n")
    elif name == "/help":
        output.err.print(HELP)
    else:
        raise MlxkvError(f"unknown command {name}: {HELP}")
    return None


def stats_line(session: ChatSession) -> str:
    s, last = session.stats(), session.last
    bpe = s.get("bits_per_element")
    return (f"tokens {s['tokens']} | turns {s['turns']}"
            + (f" | last turn: {last.prefilled} prefilled, {last.reused} reused" if last else "")
            + f" | KV {format_bytes(s['kv_bytes'] or 0)}" + (f" ({bpe:.2f} bits/element)" if bpe else ""))
