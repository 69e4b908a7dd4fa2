"""LoRA / DoRA adapters (mlx-lm's adapter folders: adapter_config.json + adapters.safetensors),
loaded into a model through mlx-lm's own `load_adapters`; a folder that does not fit the model
is one line naming what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.nn as nn

from .errors import MlxkvError

CONFIG, WEIGHTS = "adapter_config.json", "adapters.safetensors"


def check_adapter_folder(path: str | Path, what: str = "--adapter-path") -> Path:
    """The folder, checked before the model loads (missing files, a config that is not JSON);
    errors name it as `what` (the flag, or a prompts file row's "adapter")."""
    p = Path(path)
    if not p.is_dir():
        raise MlxkvError(f"{what} {p}: not a folder (an mlx-lm adapter folder holds {CONFIG} and {WEIGHTS})")
    for name in (CONFIG, WEIGHTS):
        if not (p / name).is_file():
            raise MlxkvError(f"{what} {p}: {name} not found")
    try:
        cfg = json.loads((p / CONFIG).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise MlxkvError(f"{what} {p}: {CONFIG} is not JSON ({type(e).__name__})") from None
    if not isinstance(cfg, dict):
        raise MlxkvError(f"{what} {p}: {CONFIG} must be a JSON object")
    kind = cfg.get("fine_tune_type", "lora")
    if kind not in ("lora", "dora", "full"):
        raise MlxkvError(f"{what} {p}: fine_tune_type {kind!r} is not lora, dora or full")
    if kind != "full":
        params = cfg.get("lora_parameters")
        if not isinstance(cfg.get("num_layers"), int) or not isinstance(params, dict) or "rank" not in params \
                or "scale" not in params:
            raise MlxkvError(f"{what} {p}: {CONFIG} needs num_layers and lora_parameters "
                             "{rank, scale, ...}")
    return p


def apply_adapter(model: nn.Module, path: str | Path) -> None:
    """Turn the model's layers into LoRA layers and load the adapter's weights (mlx-lm's loader)."""
    from mlx_lm.tuner.utils import load_adapters

    p = check_adapter_folder(path)
    try:
        load_adapters(model, str(p))
        model.eval()  # as mlx-lm's load: the new LoRA layers' dropout is for training only
    except ValueError as e:  # mlx-lm lists tensors that do not fit: name the first and count them
        lines = [ln.strip() for ln in str(e).splitlines()[1:] if ln.strip()]
        what = f"{lines[0]}" + (f" (and {len(lines) - 1} more)" if len(lines) > 1 else "") if lines else str(e)
        raise MlxkvError(f"--adapter-path {p} does not fit this model: {what}") from None
    except (KeyError, TypeError, AttributeError) as e:
        raise MlxkvError(f"--adapter-path {p}: {CONFIG} does not fit mlx-lm's adapter loader "
                         f"({type(e).__name__}: {e})") from None
