"""Load an mlx-lm model folder, checked: config.json is read and validated before mlx-lm sees it,
and what mlx-lm builds is checked against it, so a bad folder is one line naming what is wrong
(never mlx-lm's traceback, never a model that runs with settings it does not have)."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import MlxkvError, first_line

# counts that make no model when 0 or negative (where the config gives them as integers)
POSITIVE = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "vocab_size",
            "head_dim", "intermediate_size")
AFFINE_BITS, AFFINE_GROUPS = (2, 3, 4, 5, 6, 8), (32, 64, 128)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_config(path: Path, source: str) -> dict:
    """config.json of the folder `path` as a dict, or a one-line error naming the problem."""
    f = path / "config.json"
    where = f"model {source}: {f.name}"
    try:
        text = f.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise MlxkvError(f"{where} is not UTF-8 text") from None
    except OSError as e:
        raise MlxkvError(f"{where}: cannot read it ({e.strerror or e})") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise MlxkvError(f"{where} is not valid JSON ({e.msg}, line {e.lineno})") from None
    except RecursionError:
        raise MlxkvError(f"{where} is nested too deeply to read") from None
    if not isinstance(config, dict):
        raise MlxkvError(f"{where} must be a JSON object, got {type(config).__name__}")
    check_config(config, where)
    return config


def check_config(config: dict, where: str) -> None:
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise MlxkvError(f"{where}: 'model_type' must be a non-empty string, got {model_type!r}")
    text = config.get("text_config")
    for cfg, prefix in ((config, ""), *(((text, "text_config."),) if isinstance(text, dict) else ())):
        for key in POSITIVE:
            v = cfg.get(key)
            if v is not None and (isinstance(v, bool) or (_is_int(v) and v < 1)):
                raise MlxkvError(f"{where}: '{prefix}{key}' must be a positive integer, got {v!r}")
        heads, kv_heads = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
        if _is_int(heads) and _is_int(kv_heads) and heads % kv_heads:
            raise MlxkvError(f"{where}: {prefix}num_attention_heads {heads} is not a multiple of "
                             f"num_key_value_heads {kv_heads}")
    if "quantization" in config:  # mlx's block (a Hugging Face quantization_config is mlx-lm's to read)
        _check_quantization(config["quantization"], f"{where}: 'quantization'")


def _check_quantization(q, where: str) -> None:
    """mlx-lm's block: {"group_size", "bits", "mode"?, <layer path>: {...} | false, ...}."""
    if not isinstance(q, dict):
        raise MlxkvError(f"{where} must be an object with bits and group_size, got {q!r}")
    mode = q.get("mode", "affine")
    if not isinstance(mode, str):
        raise MlxkvError(f"{where}: 'mode' must be a string, got {mode!r}")
    for field in ("bits", "group_size"):
        v = q.get(field)
        if not _is_int(v) or v < 1:
            raise MlxkvError(f"{where}: '{field}' must be a positive integer, got {v!r}")
    if mode == "affine" and (q["bits"] not in AFFINE_BITS or q["group_size"] not in AFFINE_GROUPS):
        raise MlxkvError(f"{where}: affine bits {q['bits']} / group_size {q['group_size']} are not among "
                         f"{list(AFFINE_BITS)} / {list(AFFINE_GROUPS)}")


def _quantized_modules(model) -> int:
    return sum(1 for _, m in model.named_modules() if hasattr(m, "scales") and hasattr(m, "bits"))


def load_folder(path: Path, source: str):
    """(model, tokenizer, config) by mlx-lm's `load`, with the folder checked before and after."""
    from mlx_lm.utils import load

    if not path.is_dir():
        raise MlxkvError(f"model {source} is neither a folder nor a regular .gguf file")
    config = read_config(path, source)
    try:
        model, tokenizer, config = load(str(path), return_config=True)
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise MlxkvError(f"cannot load model {source}: {first_line(e, limit=None)}")
    except Exception as e:  # mlx-lm / transformers on a folder they cannot read: still name the folder
        first = first_line(e, None, empty="")
        raise MlxkvError(f"cannot load model {source}: {type(e).__name__}{': ' + first if first else ''}") from None
    if "quantization" in config and not _quantized_modules(model):
        raise MlxkvError(f"model {source}: config.json has a 'quantization' block but the weights hold no "
                         f"quantized layer (remove the block, or use the quantized weights)")
    layers = getattr(model, "layers", None)
    if layers is not None and len(layers) == 0:
        raise MlxkvError(f"model {source}: the model has no layers")
    return model, tokenizer, config
