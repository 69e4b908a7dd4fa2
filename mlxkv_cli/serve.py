"""`mlxkv serve`: parse -> ServeConfig -> kvcore.serve.serve (an OpenAI-compatible server)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from typer.core import TyperCommand

from kvcore.models import dtype_name
from kvcore.units import format_bytes, parse_bytes

from .hub import fetch_model
from .options import (BatchSizeOpt, DtypeOpt, KeepOpt, KvBitsOpt, KvConfigOpt, KvGroupOpt, KvOpt, KvStartOpt,
                      MaxKvBytesOpt, MaxKvOpt, MaxTokensOpt, ModelOpt, OfflineOpt, PrefillChunkOpt, ProfileOpt,
                      reworded)
from .output import err

DefaultTokensOpt = reworded(MaxTokensOpt, "A chat request's max_tokens when it sets none (clamped to the context).")
StepChunkOpt = reworded(PrefillChunkOpt, "Prompt tokens per forward pass (one chunk between decode steps).")


def serve(
    model: ModelOpt = None,
    dtype: DtypeOpt = None,
    host: Annotated[str, typer.Option(help="Address to listen on (127.0.0.1: this machine only; 0.0.0.0: every interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free port).")] = 8080,
    batch_size: BatchSizeOpt = 8,
    max_kv_bytes: MaxKvBytesOpt = None,
    max_queue: Annotated[int, typer.Option(help="Rows waiting beyond the running batch (a request with n choices is n rows); more are refused with 429.")] = 64,
    api_key: Annotated[Optional[str], typer.Option(envvar="MLXKV_API_KEY", show_envvar=True, help="Require `Authorization: Bearer KEY` on every route but /health.")] = None,
    max_body_bytes: Annotated[str, typer.Option(help="Largest request body (413 beyond it).")] = "4MiB",
    max_tokens: DefaultTokensOpt = 512,
    prefill_chunk: StepChunkOpt = 512,
    served_model_name: Annotated[Optional[str], typer.Option(help="The model id clients name (default: the model's name).")] = None,
    lora_modules: Annotated[Optional[list[str]], typer.Option(help="LoRA adapter served beside the model: NAME=DIR (an mlx-lm adapter folder), for requests whose model is NAME (several after one flag, or repeated).")] = None,
    cors: Annotated[Optional[list[str]], typer.Option(help="Allow browser requests from this origin (repeatable; default: none).")] = None,
    shutdown_timeout: Annotated[float, typer.Option(help="Seconds running requests get to finish on SIGINT/SIGTERM.")] = 30.0,
    prefix_cache_bytes: Annotated[str, typer.Option(help="RAM for the caches of earlier prompts, reused by requests that start with them, e.g. 4GB (0: off).")] = "0",
    prefix_cache_dir: Annotated[Optional[str], typer.Option(help="Folder the prefix cache spills to (evicted prompts, and all it holds at a stop) and reads back, also across restarts (made if missing).")] = None,
    prefix_cache_dir_bytes: Annotated[str, typer.Option(help="Bound on this server's files in --prefix-cache-dir (oldest removed first).")] = "8GiB",
    kv: KvOpt = None,
    kv_bits: KvBitsOpt = None,
    kv_group_size: KvGroupOpt = None,
    quantized_kv_start: KvStartOpt = None,
    kv_config: KvConfigOpt = None,
    max_kv_size: MaxKvOpt = None,
    kv_keep: KeepOpt = None,
    profile: ProfileOpt = None,
    offline: OfflineOpt = False,
):
    """Serve the model over an OpenAI-compatible HTTP API (needs the serve extra)."""
    from kvcore.policy import KVOptions, resolve_policy
    from kvcore.serve import ServeConfig, require_extra
    from kvcore.serve import serve as run_server
    from kvcore.serve.config import lora_module

    require_extra()
    config = ServeConfig(
        model=model, dtype=dtype_name(dtype),
        kv=KVOptions(kv_bits, kv_group_size, quantized_kv_start, str(kv_config) if kv_config else None,
                     max_kv_size, kv_keep, profile, kv),
        host=host, port=port, batch_size=batch_size,
        max_kv_bytes=parse_bytes(max_kv_bytes, "--max-kv-bytes") if max_kv_bytes else None,
        max_queue=max_queue, api_key=api_key, max_body_bytes=parse_bytes(max_body_bytes, "--max-body-bytes"),
        max_tokens=max_tokens, prefill_chunk=prefill_chunk, model_name=served_model_name,
        cors=tuple(cors or ()), shutdown_timeout=shutdown_timeout,
        prefix_cache_bytes=parse_bytes(prefix_cache_bytes, "--prefix-cache-bytes"),
        prefix_cache_dir=prefix_cache_dir,
        prefix_cache_dir_bytes=parse_bytes(prefix_cache_dir_bytes, "--prefix-cache-dir-bytes"),
        lora_modules=tuple(lora_module(v) for v in lora_modules or ()),
    )
    resolve_policy(config.kv)  # bad KV flags fail before any download
    fetch_model(model, offline)

    def ready(served, bound_port: int):
        shown = f"[{host}]" if ":" in host else host
        err.print(f"serving {served.name} on http://{shown}:{bound_port}/v1 | batch {batch_size} | "
                  f"KV {served.policy.label()} | KV budget {format_bytes(served.budget)}"
                  f"{f' | prefix cache dir {prefix_cache_dir}' if prefix_cache_dir else ''}"
                  f"{' | adapters ' + ', '.join(served.adapters) if served.adapters else ''}"
                  f"{' | API key required' if api_key else ''} (Ctrl+C stops)")

    run_server(config, on_ready=ready)
    err.print("server stopped")
    exit_now(0)


LORA_FLAG = "--lora-modules"


class ServeCommand(TyperCommand):
    """serve's command line: `--lora-modules A=X B=Y` (vLLM's form: the values up to the next option)
    is read as `--lora-modules A=X --lora-modules B=Y` (serve takes no arguments of its own)."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        return super().parse_args(ctx, spread_values(args, LORA_FLAG))


def spread_values(args: list[str], flag: str) -> list[str]:
    """The bare words after `flag`'s value, each given its own `flag`."""
    out, i, spreading = [], 0, False
    while i < len(args):
        a = args[i]
        if spreading and not a.startswith("-"):
            out += [flag, a]
            i += 1
            continue
        if a == "--":
            return out + args[i:]
        spreading = a == flag and i + 1 < len(args) or a.startswith(flag + "=")
        take = 2 if a == flag else 1
        out += args[i:i + take]
        i += take
    return out


def exit_now(code: int) -> None:
    """End the process without running C++ static and thread-local destructors.

    MLX used on a thread other than the main one (the engine thread) can abort the interpreter's
    teardown now and then ("terminate called without an active exception", ml-explore/mlx#3126);
    everything is stopped and flushed by here, so nothing is lost by skipping it."""
    import logging
    import os
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
