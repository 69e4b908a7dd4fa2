"""What `fit` needs of a model without running it: its config, the bytes its weights take once
loaded, and the dtype its KV cache would be stored in.

A folder: config.json and the safetensors headers (no array is read). A GGUF file: the config
and weights as `load_gguf` builds them (quantized tensors stay quantized, K-quants are decoded
as loading decodes them), counted, never evaluated into a model.
KV dtype: what a run computes keys in: the token embedding's dtype (a quantized table: its
scales') promoted with layer 0's key projection's; float16 with bfloat16 promotes to float32.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import MlxkvError
from .models import resolve_model_path

SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class ModelShape:
    config: dict
    weight_bytes: int
    kv_dtype: str  # "float32" | "float16" | "bfloat16"

    @property
    def kv_dtype_bytes(self) -> int:
        return SIZES[self.kv_dtype]


def _promote(dtypes: list[str]) -> str | None:
    got = {d for d in dtypes if d in SIZES}
    if not got:
        return None
    if len(got) == 1:
        return got.pop()
    return "float32"  # float32 wins; float16 with bfloat16 promotes to float32 in MLX


def kv_dtype_of(tensors: dict[str, str]) -> str:
    """The KV dtype a run would use, from {tensor name: dtype name} of the model's weights."""
    embed = [d for n, d in tensors.items() if n.endswith(("embed_tokens.weight", "embed_tokens.scales"))]
    key = [d for n, d in tensors.items() if "layers.0." in n and "k_proj" in n and n.endswith(("weight", "scales"))]
    picked = _promote([d for d in embed + key if d in SIZES])
    if picked:
        return picked
    floats = [d for d in tensors.values() if d in SIZES]
    return max(set(floats), key=floats.count) if floats else "float32"


def _folder(path: Path) -> ModelShape:
    from .store.safetensors import open_container

    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        raise MlxkvError(f"model folder {path}: config.json is not readable JSON") from None
    if not isinstance(config, dict):
        raise MlxkvError(f"model folder {path}: config.json is not a JSON object")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise MlxkvError(f"model folder {path} has no .safetensors weights")
    tensors, total = {}, 0
    for f in files:
        c = open_container(f)
        total += sum(t.nbytes for t in c.tensors.values())
        tensors.update({n: t.dtype for n, t in c.tensors.items()})
    return ModelShape(config, total, kv_dtype_of(tensors))


def _gguf(path: Path) -> ModelShape:
    from .gguf.config import build_config
    from .gguf.reader import read_gguf
    from .gguf.weights import convert_weights

    gguf = read_gguf(path)
    config = build_config(gguf)
    weights, quant = convert_weights(gguf, config)
    if quant is not None:
        config["quantization"] = quant
    dtypes = {n: str(w.dtype).rsplit(".", 1)[-1] for n, w in weights.items()}
    return ModelShape(config, sum(w.nbytes for w in weights.values()), kv_dtype_of(dtypes))


def model_shape(ref: str | None) -> ModelShape:
    path, _ = resolve_model_path(ref)
    if path.is_file():
        if path.suffix != ".gguf":
            raise MlxkvError(f"unsupported model file {path.name}: expected a folder or a .gguf file")
        return _gguf(path)
    return _folder(path)
