"""Rendering: streamed text, the stats line, JSON Lines, the per-layer plan table."""

from __future__ import annotations

import json
import sys

from rich.console import Console
from rich.table import Table

err = Console(stderr=True, highlight=False, soft_wrap=True)


def json_line(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def stream_text(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def notice(message: str) -> None:
    err.print(f"[yellow]note:[/yellow] {message}")


def json_completion(c) -> None:
    json_line(c.to_json())


def labelled_completion(c) -> None:
    stream_text(f"── {c.id} ({len(c.token_ids)} tokens, {c.finish_reason})\n{c.text}\n")


def batch_stats_line(s: dict) -> None:
    bpe = s["bits_per_element"]
    err.print(
        f"rows: {s['rows']} (batch {s['batch_size']}) | prompt tokens {s['prompt_tokens']} | "
        f"generated {s['generated_tokens']} tokens, {s['aggregate_tps']:.1f} tok/s aggregate | "
        f"peak memory {s['peak_memory_bytes'] / 2**20:.1f} MiB | peak KV {(s['kv_bytes'] or 0) / 2**10:.1f} KiB"
        + (f" ({bpe:.2f} bits/element)" if bpe else "")
        + f" | {s['backend']} | attention: {s['attention_path']}"
    )


def stats_line(c, summary: dict) -> None:
    bpe = summary["bits_per_element"]
    err.print(
        f"prompt: {c.prompt_tokens} tokens, {c.prompt_tps:.1f} tok/s | "
        f"generation: {len(c.token_ids)} tokens, {c.gen_tps:.1f} tok/s | "
        f"peak memory {summary['peak_memory_bytes'] / 2**20:.1f} MiB | "
        f"KV {summary['kv_bytes'] / 2**10:.1f} KiB"
        + (f" ({bpe:.2f} bits/element)" if bpe else "")
        + f" | {summary['backend']} | attention: {summary['attention_path']}"
    )


def plan_table(plan: list[dict]) -> None:
    t = Table(title="KV plan", show_lines=False)
    for col in ("layer", "kind", "codec", "bits", "group", "start", "window", "keep"):
        t.add_column(col)
    for p in plan:
        t.add_row(*(str(p[k] if p[k] is not None else "-") for k in
                    ("layer", "kind", "codec", "bits", "group_size", "start", "window", "keep")))
    err.print(t)


def spec_stats_line(s: dict) -> None:
    rate = s["acceptance_rate"]
    err.print(
        f"speculative ({s['draft']}, {s['num_draft_tokens']} a round): "
        f"{s['accepted_tokens']}/{s['drafted_tokens']} drafts accepted"
        + (f" ({100 * rate:.0f}%)" if rate is not None else "")
        + f", mean accepted {s['mean_accepted'] or 0:.2f}, {s['tokens_per_step'] or 0:.2f} tokens/step | "
        f"{s['verified_tokens']} verified in {s['rounds']} passes | accepted histogram {s['accepted_histogram']}"
    )
