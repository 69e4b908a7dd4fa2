"""load_gguf (in memory) and convert_gguf (to an mlx-lm folder)."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kvcore.errors import MlxkvError
from kvcore.store.atomic import check_writable
from kvcore.gguf.config import arch_spec, build_config
from kvcore.gguf.reader import GGUFFile, read_gguf
from kvcore.gguf.tokenizer import TokenizerSpec, build_tokenizer
from kvcore.gguf.validate import check_tensors, check_vocabulary
from kvcore.gguf.weights import convert_weights

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def parse_dtype(dtype: str | mx.Dtype | None) -> mx.Dtype | None:
    if dtype is None or isinstance(dtype, mx.Dtype):
        return dtype
    if dtype not in DTYPES:
        raise MlxkvError(f"unsupported dtype '{dtype}' (choose {', '.join(DTYPES)})")
    return DTYPES[dtype]


def _prepare(path: str | Path, dtype: Any, dequantize: bool
             ) -> tuple[GGUFFile, dict[str, Any], dict[str, mx.array], TokenizerSpec]:
    dtype = parse_dtype(dtype)
    gguf = read_gguf(path)
    config = build_config(gguf)
    check_tensors(gguf, config, arch_spec(gguf)[1].attention_bias)
    check_vocabulary(gguf, config)
    weights, quant = convert_weights(gguf, config, dtype=dtype, dequantize=dequantize)
    if quant is not None:
        config["quantization"] = quant
        config["quantization_config"] = quant
    tok = build_tokenizer(gguf, config["max_position_embeddings"])
    extra = tok.extra_eos_ids
    if extra and "eos_token_id" in config:
        config["eos_token_id"] = [config["eos_token_id"], *extra]
    return gguf, config, weights, tok


def build_model(config: dict[str, Any], weights: dict[str, mx.array]) -> nn.Module:
    """An mlx-lm model from its config and HF-named weights (as mlx_lm.load does)."""
    from mlx_lm.utils import infer_quant_config

    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    weights = model.sanitize(weights) if hasattr(model, "sanitize") else weights
    quant = config.get("quantization")
    if quant is not None:
        def predicate(p: str, m: nn.Module) -> Any:
            if p in quant:
                return quant[p]
            if not hasattr(m, "to_quantized") or f"{p}.scales" not in weights:
                return False
            return infer_quant_config(p, m, weights)

        nn.quantize(model, group_size=quant["group_size"], bits=quant["bits"],
                    mode=quant.get("mode", "affine"), class_predicate=predicate)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        msg = " ".join(str(e).split())[:300]
        arch = config["model_type"]
        raise MlxkvError(f"GGUF tensors do not fit the {arch} model: {msg}") from None
    mx.eval(model.parameters())
    model.eval()
    return model


def load_gguf(path: str | Path, dtype: mx.Dtype | None = None, dequantize: bool = False
              ) -> tuple[nn.Module, Any, dict[str, Any]]:
    """(mlx-lm model, TokenizerWrapper, HF-style config) from a GGUF file.

    Q4_0/Q4_1/Q8_0 tensors stay MLX affine-quantized (group 32) unless dequantize
    (then dense in dtype, default float32). Other tensors are dense (cast to dtype if given).
    """
    _, config, weights, tok = _prepare(path, dtype, dequantize)
    return build_model(config, weights), tok.wrapper(), config


def convert_gguf(path: str | Path, out_dir: str | Path, dequantize: bool = False,
                 dtype: mx.Dtype | str | None = None) -> Path:
    """Write an mlx-lm loadable folder; atomic (temp dir beside out_dir, then rename)."""
    out = _check_output(out_dir)
    _, config, weights, tok = _prepare(path, dtype, dequantize)
    build_model(config, weights)  # the folder must load: refused here, before anything is written
    tok.hf()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as e:
        raise MlxkvError(f"cannot write {out}: {e.strerror or e}") from None
    try:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        gen = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        tok.save(tmp)
        os.chmod(tmp, 0o755)
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise MlxkvError(f"cannot write {out}: {e.strerror or e}") from None
        raise
    return out


def _check_output(out_dir: str | Path) -> Path:
    """The output folder, checked before the conversion starts: absent or empty, and creatable."""
    out = Path(out_dir).expanduser().absolute()
    try:
        out = out.resolve()
    except (OSError, RuntimeError):  # a symlink loop on the way
        raise MlxkvError(f"cannot write {out}: too many levels of symbolic links") from None
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MlxkvError(f"output exists and is not an empty folder: {out}")
    folder = out.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise MlxkvError(f"cannot write {out}: {folder} is not a folder")
    check_writable(folder, out)
    return out
