"""`mlxkv convert-model`: a GGUF file -> an mlx-lm model folder."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Literal, Optional

import typer
from rich.console import Console

from kvcore.errors import MlxkvError

DType = Literal["float32", "float16", "bfloat16"]


def convert_model(
    gguf: Annotated[Path, typer.Argument(help="Input .gguf file (llama-family).")],
    out: Annotated[Path, typer.Argument(help="Output folder; must not exist or be empty.")],
    dequantize: Annotated[bool, typer.Option(
        "--dequantize", help="Store dense weights instead of MLX 4/8-bit affine.")] = False,
    dtype: Annotated[Optional[DType], typer.Option(
        "--dtype", help="Dtype of dense weights (and of quantization scales).")] = None,
) -> None:
    """Convert a GGUF file into an mlx-lm folder (config.json, model.safetensors, tokenizer)."""
    from kvcore.gguf import convert_gguf

    if not gguf.is_file():
        raise MlxkvError(f"GGUF {gguf} is not a regular file" if gguf.exists() else f"GGUF file not found: {gguf}")
    dt = getattr(dtype, "value", dtype)  # plain str
    start = time.perf_counter()
    folder = convert_gguf(gguf, out, dequantize=dequantize, dtype=dt)
    size = sum(f.stat().st_size for f in folder.iterdir()) / 2**20
    quant = "dense" if dequantize else "quantized as stored"
    Console().print(f"[green]converted[/] {gguf.name} -> {folder} "
                    f"({size:.0f} MiB, {quant}{', ' + dt if dt else ''}, "
                    f"{time.perf_counter() - start:.1f} s)")
