"""Find and load a model: the embedded default, a local folder, a GGUF file, or a repo id
from the local Hugging Face cache (downloading is the caller's step: `kvcore.hub`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn

from .errors import MlxkvError

DEFAULT_MODEL = Path(__file__).resolve().parent / "assets" / "stories260K"
EMBEDDED = "embedded:stories260K"
EMBEDDED_NAMES = ("embedded", "stories260K", EMBEDDED)  # what -m takes to name the embedded model
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # as --kv spells them


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: object  # mlx_lm TokenizerWrapper
    config: dict
    source: str  # what the user named (or "embedded:stories260K")
    path: Path


def dtype_name(name: str | None) -> str | None:
    """`float16`, `fp16` -> "float16"; None stays None; anything else is a one-line error."""
    if name is None:
        return None
    full = DTYPE_ALIASES.get(name, name)
    if full not in DTYPES:
        raise MlxkvError(f"unknown dtype {name!r} (choose from {', '.join([*DTYPES, *DTYPE_ALIASES])})")
    return full


def parse_dtype(name: str | None) -> mx.Dtype | None:
    full = dtype_name(name)
    return None if full is None else DTYPES[full]


def is_repo_id(ref: str | None) -> bool:
    """`org/name` that is not a local path: a Hugging Face repo id."""
    if ref is None or ref in EMBEDDED_NAMES or Path(ref).expanduser().exists():
        return False
    return not ref.startswith((".", "/", "~")) and not ref.endswith(".gguf") and ref.count("/") == 1


def resolve_model_path(ref: str | None) -> tuple[Path, str]:
    if ref is None or ref in EMBEDDED_NAMES:
        return DEFAULT_MODEL, EMBEDDED
    p = Path(ref).expanduser()
    if p.exists():
        if p.is_dir() and not (p / "config.json").is_file():
            raise MlxkvError(f"model folder {p} has no config.json")
        return p, ref
    if not is_repo_id(ref):
        raise MlxkvError(f"model not found: {ref} (a folder, a .gguf file, a repo id, or 'embedded')")
    from .hub import cached_snapshot

    path = cached_snapshot(ref)
    if path is None:
        raise MlxkvError(
            f"model {ref!r} is not available locally (offline); download it first with "
            f"`hf download {ref}`, run without --offline / HF_HUB_OFFLINE, or pass a local folder"
        )
    return path, ref


def _add_stop_ids(tokenizer, path: Path, extra_eos: Sequence[str]) -> None:
    """EOS ids from the folder's generation_config.json (the embedded model ends a story with BOS)
    and `extra_eos` (mlx-lm's --extra-eos-token: token strings or ids)."""
    gen = path / "generation_config.json" if path.is_dir() else None
    ids = []
    if gen is not None and gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            raise MlxkvError(f"{gen}: not a valid JSON object") from None
        ids = [eos] if isinstance(eos, int) else [i for i in (eos or []) if isinstance(i, int)]
    vocab = tokenizer.get_vocab() if extra_eos else {}
    for token in extra_eos:
        tid = int(token) if str(token).isdigit() else vocab.get(token)
        if tid is None or not 0 <= tid < max(len(vocab), 1):
            raise MlxkvError(f"--extra-eos-token {token!r} is not a token of this tokenizer")
        ids.append(tid)
    for tid in ids:
        tokenizer.add_eos_token(str(tid))


def _quiet_length_warning(tokenizer) -> None:
    """transformers warns when a text is longer than `model_max_length`; mlxkv says it itself
    (`context_notice`), counting the tokens to be generated too."""
    inner = getattr(tokenizer, "_tokenizer", None)
    if inner is not None and hasattr(inner, "model_max_length"):
        inner.model_max_length = 10**30


def load_model(ref: str | None = None, dtype: str | None = None, extra_eos: Sequence[str] = ()) -> LoadedModel:
    path, source = resolve_model_path(ref)
    mx_dtype = parse_dtype(dtype)
    if path.is_file():
        if path.suffix != ".gguf":
            raise MlxkvError(f"unsupported model file {path.name}: expected a folder or a .gguf file")
        from .gguf import load_gguf

        model, tokenizer, config = load_gguf(path, dtype=mx_dtype)
    else:
        from .model_folder import load_folder

        model, tokenizer, config = load_folder(path, source)
    if mx_dtype is not None:
        model.set_dtype(mx_dtype)
    _add_stop_ids(tokenizer, path, extra_eos)
    _quiet_length_warning(tokenizer)
    return LoadedModel(model, tokenizer, config, source, path)


def trained_context(config: dict) -> int | None:
    """The context the model was trained for (max_position_embeddings), if the config says."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    n = text.get("max_position_embeddings")
    return n if isinstance(n, int) and n > 0 else None


def context_notice(config: dict, lengths: Sequence[int]) -> str | None:
    """One notice when rows (prompt + max tokens each, `lengths`) run past the trained context."""
    limit = trained_context(config)
    over = [n for n in lengths if limit and n > limit]
    if not over:
        return None
    rows = f"prompt + max tokens = {over[0]} tokens" if len(lengths) == 1 else (
        f"{len(over)} of {len(lengths)} rows (prompt + max tokens up to {max(over)} tokens)")
    return (f"{rows} run past the model's trained context of {limit} tokens (max_position_embeddings): "
            f"output beyond it is unreliable")


def read_config(ref: str | None) -> dict | None:
    """config.json of a model folder (embedded, local or cached repo), without loading weights;
    None for a GGUF file (its settings are in the file's metadata)."""
    path, _ = resolve_model_path(ref)
    if path.is_file():
        return None
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        raise MlxkvError(f"model folder {path}: config.json is not readable JSON") from None
