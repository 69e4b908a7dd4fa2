"""What `fit` needs of a model without running it: its config, the bytes its weights take once
loaded, and the dtype its KV cache would be stored in.

A folder: config.json and the safetensors headers (no array is read). A GGUF file: the config
and weights as `load_gguf` builds them (quantized tensors stay quantized, K-quants are decoded
as loading decodes them), counted, never evaluated into a model.
KV dtype: what a run computes keys in: the token embedding's dtype (a quantized table: its
scales') promoted with layer 0's key projection's; float16 with bfloat16 promotes to float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import MlxkvError
from .model_folder import read_config
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


def check_shape_fields(config: dict, where: str) -> None:
    """The fields the KV byte model sizes a cache from (cache/bytes.py's layer_shapes): present
    and positive integers, or a one-line error naming the first that is not."""
    text = config.get("text_config")
    c, prefix = (text, "text_config.") if isinstance(text, dict) else (config, "")
    need = ["num_hidden_layers", "num_attention_heads", "head_dim" if "head_dim" in c else "hidden_size"]
    for key in need + [k for k in ("num_key_value_heads",) if c.get(k) is not None]:
        v = c.get(key)
        if v is None:
            alt = " (or 'head_dim')" if key == "hidden_size" else ""
            raise MlxkvError(f"{where}: '{prefix}{key}'{alt} is missing (the KV cache is sized from it)")
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise MlxkvError(f"{where}: '{prefix}{key}' must be a positive integer, got {v!r}")


def _folder(path: Path, source: str) -> ModelShape:
    from .store.safetensors import open_container

    config = read_config(path, source)  # the checks every command's model load makes
    check_shape_fields(config, f"model {source}: config.json")
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
    check_shape_fields(config, f"GGUF {path.name}")
    weights, quant = convert_weights(gguf, config)
    if quant is not None:
        config["quantization"] = quant
    dtypes = {n: str(w.dtype).rsplit(".", 1)[-1] for n, w in weights.items()}
    return ModelShape(config, sum(w.nbytes for w in weights.values()), kv_dtype_of(dtypes))


def model_shape(ref: str | None) -> ModelShape:
    path, source = resolve_model_path(ref)
    if path.is_file():
        if path.suffix != ".gguf":
            raise MlxkvError(f"unsupported model file {path.name}: expected a folder or a .gguf file")
        return _gguf(path)
    return _folder(path, source)


def check_layers(config: dict, policy) -> None:
    """A kv_config's layers against the model's (from config.json alone, as `plan_layers` checks a
    loaded model): one the model lacks, or one holding no KV of its own (SSM, KV-shared)."""
    if policy.layer_codecs is None:
        return
    from .cache.bytes import layer_shapes

    shapes = layer_shapes(config)
    for idx, _ in policy.layer_codecs:
        if idx >= len(shapes):
            raise MlxkvError(f"kv_config: layer_idx {idx} out of range (model has {len(shapes)} layers)")
        if shapes[idx].kind == "other":
            raise MlxkvError(f"kv_config: layer_idx {idx} holds no KV cache of its own (a linear-attention or "
                             f"KV-shared layer)")
