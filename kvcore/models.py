"""Find and load a model: the embedded default, a local folder, a GGUF file, or a repo id
from the local Hugging Face cache (never downloads)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from .errors import MlxkvError

DEFAULT_MODEL = Path(__file__).resolve().parent / "assets" / "stories260K"
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: object  # mlx_lm TokenizerWrapper
    config: dict
    source: str  # what the user named (or "embedded:stories260K")
    path: Path


def parse_dtype(name: str | None) -> mx.Dtype | None:
    if name is None:
        return None
    try:
        return DTYPES[name]
    except KeyError:
        raise MlxkvError(f"unknown dtype {name!r} (choose from {', '.join(DTYPES)})")


def resolve_model_path(ref: str | None) -> tuple[Path, str]:
    if ref is None:
        return DEFAULT_MODEL, "embedded:stories260K"
    p = Path(ref).expanduser()
    if p.exists():
        if p.is_dir() and not (p / "config.json").is_file():
            raise MlxkvError(f"model folder {p} has no config.json")
        return p, ref
    if ref.startswith((".", "/", "~")) or ref.endswith(".gguf") or ref.count("/") != 1:
        raise MlxkvError(f"model not found: {ref}")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(ref, local_files_only=True)), ref
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
        raise MlxkvError(
            f"model {ref!r} is not available locally (offline); download it first with "
            f"`hf download {ref}` or pass a local folder"
        )


def load_model(ref: str | None = None, dtype: str | None = None) -> LoadedModel:
    path, source = resolve_model_path(ref)
    mx_dtype = parse_dtype(dtype)
    if path.is_file():
        if path.suffix != ".gguf":
            raise MlxkvError(f"unsupported model file {path.name}: expected a folder or a .gguf file")
        from .gguf import load_gguf

        model, tokenizer, config = load_gguf(path, dtype=mx_dtype)
    else:
        from mlx_lm.utils import load

        try:
            model, tokenizer, config = load(str(path), return_config=True)
        except (ValueError, FileNotFoundError, KeyError) as e:
            raise MlxkvError(f"cannot load model {source}: {str(e).splitlines()[0]}")
    if mx_dtype is not None:
        model.set_dtype(mx_dtype)
    return LoadedModel(model, tokenizer, config, source, path)
