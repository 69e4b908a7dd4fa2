"""`mlxkv inspect-cache FILE`: what a KV cache file holds (mlxkv files and mlx-lm prompt caches)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from kvcore.models import load_model
from kvcore.units import format_bytes

from .hub import fetch_model
from .options import OfflineOpt

COLUMNS = (("layer", "layer"), ("kind", "kind"), ("codec", "codec"), ("bits", "bits"), ("group", "group_size"),
           ("tokens", "tokens"), ("bytes", "bytes"), ("bits/el", "bits_per_element"))


def _cell(value) -> str:
    return "-" if value is None else str(value)


def render(report: dict, console: Console) -> None:
    t = Table(title=f"{report['file']} ({report['format']}, {format_bytes(report['file_bytes'])})")
    for title, _ in COLUMNS:
        t.add_column(title, justify="right" if title not in ("kind", "codec") else "left", no_wrap=True)
    for row in report["layers"]:
        t.add_row(*(_cell(row.get(key)) for _, key in COLUMNS))
    console.print(t)
    tot = report["totals"]
    bpe = f", {tot['bits_per_element']} bits/element" if tot["bits_per_element"] else ""
    state = f", other state {format_bytes(tot['state_bytes'])}" if tot["state_bytes"] else ""
    console.print(f"total: KV {format_bytes(tot['kv_bytes'])} ({tot['kv_bytes']} bytes){bpe}{state}")
    if report.get("model"):
        m = report["model"]
        console.print(f"model: {m.get('model_type')} ({m.get('architecture')}), {m.get('layers')} layers, "
                      f"{m.get('kv_heads')} KV heads, head_dim {m.get('head_dim')}; config "
                      f"{str(m.get('config_sha256'))[:12]}, vocabulary {str(m.get('tokenizer_sha256'))[:12]}")
    if report.get("sharding"):
        sh = report["sharding"]
        heads = f", {sh['kv_heads']} KV heads per rank" if sh.get("kv_heads") else ""
        files = f"; the set: {', '.join(sh['set'])}" if sh.get("set") else ""
        console.print(f"sharding: rank {sh['rank']} of {sh['ranks']}{heads}; continues only under {sh['ranks']} "
                      f"ranks, as rank {sh['rank']}{files}")
    if "prefix_tokens" in report:
        console.print(f"prefix: {report['prefix_tokens']} tokens, first ids {report['prefix_ids']}")
    if "prefix_text" in report:
        console.print(f"prefix text: {report['prefix_text']!r}")
    for key in ("model_check", "note", "created"):
        if report.get(key):
            console.print(f"{key.replace('_', ' ')}: {report[key]}")


def inspect_cache(
    file: Annotated[Path, typer.Argument(help="An mlxkv cache file, or an mlx-lm prompt cache (.safetensors).")],
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Check the cache against this model and decode the first prefix tokens with its tokenizer: a folder, .gguf, repo id, or 'embedded' (the default model).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
    offline: OfflineOpt = False,
):
    """Show what a KV cache file holds: per layer kind, codec, tokens, bytes; totals; fingerprint."""
    from kvcore.store import inspect_cache as inspect_report
    fetch_model(model, offline)
    lm = load_model(model) if model else None
    report = inspect_report(file, lm)
    if json_out:
        print(json.dumps(report))
        return
    render(report, Console(highlight=False, soft_wrap=True))
