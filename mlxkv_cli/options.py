"""Shared option aliases (one definition per flag, reused by every command)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Annotated, Optional, get_args

import typer


def reworded(alias, help: str):
    """`alias` in a command's own words: the same flag names and type, another help text."""
    base, info = get_args(alias)[:2]
    info = copy.copy(info)
    info.help = help
    return Annotated[base, info]


ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="Local folder, .gguf file, or a Hugging Face repo id (downloaded unless cached or --offline). Default: the embedded stories260K model (also named 'embedded').")]
OfflineOpt = Annotated[bool, typer.Option("--offline", help="Never download: a repo id must be in the local Hugging Face cache (as HF_HUB_OFFLINE=1).")]
DtypeOpt = Annotated[Optional[str], typer.Option(help="Activation/KV dtype: float32, float16 or bfloat16 (fp32, fp16, bf16; default: the model's).")]
KvOpt = Annotated[Optional[str], typer.Option("--kv", help="KV scheme: full, affine:4, affine:4/g32, turbo:k4v3, turbo:4/r16 (/rN: N newest tokens full precision), config:FILE. Compresses from the first token unless --quantized-kv-start is given.")]
KvBitsOpt = Annotated[Optional[int], typer.Option(help="Quantize KV to this many bits (2,3,4,5,6,8), affine codec.")]
KvGroupOpt = Annotated[Optional[int], typer.Option(help="Quantization group size (32, 64, 128). Default 64.")]
KvStartOpt = Annotated[Optional[int], typer.Option(help="Keep the first N tokens full precision, then convert (default 5000 with --kv-bits as in mlx-lm, 0 with --kv-config).")]
KvConfigOpt = Annotated[Optional[Path], typer.Option(help="optiq-style kv_config.json: per-layer bits/group_size; unlisted layers stay full.")]
MaxKvOpt = Annotated[Optional[int], typer.Option(help="Sliding window for every full-attention layer (tokens kept, incl. --kv-keep).")]
KeepOpt = Annotated[Optional[int], typer.Option("--kv-keep", help="With --max-kv-size: initial tokens always kept (attention sink). Default 4.")]
ProfileOpt = Annotated[Optional[str], typer.Option(help="KV preset: a name in profiles/ (full, q8, q4, q4-delayed) or a .toml path. Flags override it.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="JSON Lines on stdout: one object per completion, then a summary.")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Show the per-layer KV plan.")]
AdapterOpt = Annotated[Optional[Path], typer.Option(help="An mlx-lm LoRA/DoRA adapter folder (adapter_config.json, adapters.safetensors) loaded into the model.")]

# the prompt, sampling and prefill (generate, chat, serve); defaults stay in each command's signature
SystemPromptOpt = Annotated[Optional[str], typer.Option(help="System message (chat template), else prepended.")]
MaxTokensOpt = Annotated[int, typer.Option("--max-tokens", "-n", help="Tokens to generate.")]
TempOpt = Annotated[float, typer.Option(help="Sampling temperature (0 = greedy).")]
TopPOpt = Annotated[float, typer.Option(help="Nucleus sampling mass.")]
MinPOpt = Annotated[float, typer.Option(help="Min-p sampling threshold.")]
TopKOpt = Annotated[int, typer.Option(help="Sample from the K most likely tokens only (0 = off).")]
SeedOpt = Annotated[Optional[int], typer.Option(help="Random seed.")]
RepetitionPenaltyOpt = Annotated[float, typer.Option(help="Penalty for tokens seen in the last --repetition-context-size tokens (1 = off; mlx-lm's rule).")]
RepetitionContextOpt = Annotated[int, typer.Option(help="Tokens the repetition penalty looks back on.")]
PrefillChunkOpt = Annotated[int, typer.Option(help="Prompt tokens per forward pass (mlx-lm: 2048).")]
BatchSizeOpt = Annotated[int, typer.Option(help="Most rows decoding together (continuous batching).")]
MaxKvBytesOpt = Annotated[Optional[str], typer.Option(help="KV budget for admitting rows, e.g. 2GB (default: the GPU's working set or half of RAM).")]

# measured text (fidelity, calibrate)
TextOpt = Annotated[Optional[list[Path]], typer.Option("--text", "-t", help="Held-out text file (repeatable). Default: the public-domain sample shipped with mlxkv.")]
WindowsOpt = Annotated[int, typer.Option(help="Windows per text.")]
WindowTokensOpt = Annotated[int, typer.Option(help="Tokens per window.")]
