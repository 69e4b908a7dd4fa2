"""Read a GGUF file: a pure-Python header walk (validation, tensor types) + mx.load.

mx.load(path, return_metadata=True) (mlx 0.32.4) does the heavy lifting:
- Q4_0 / Q4_1 / Q8_0 come back as MLX affine quantization, group 32
  (`name.weight` uint32 packed, `name.scales`, `name.biases` float16), bit-exact;
- F32 / F16 / I8..I32 come back dense;
- Q2_K / Q4_K / Q6_K / BF16 are decoded by mlx's gguflib to float16: Q4_K wrongly
  (gguflib bug), BF16 lossily; we re-decode Q4_K / Q6_K / BF16 from the raw bytes
  (kquants.py) and refuse Q2_K (unverified);
- any other type makes mx.load fail without naming the tensor, so we check the
  types from our own header walk first and name the offending tensor.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from kvcore.errors import MlxkvError, first_line
from kvcore.gguf import kquants

# ggml type id -> (name, elements per block, bytes per block)
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1),
    25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
}
QUANT_NATIVE = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}  # mx.load -> MLX affine bits, group 32
REDECODED = {"Q4_K", "Q6_K", "BF16"}  # mx.load reads them, we re-decode them exactly
DENSE = {"F32", "F16", "I8", "I16", "I32"}
SUPPORTED = set(QUANT_NATIVE) | REDECODED | DENSE

# metadata value type id -> struct format of a scalar (8 = string, 9 = array)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
           10: "Q", 11: "q", 12: "d"}


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # MLX order (ggml dims reversed)
    type_name: str
    offset: int  # absolute file offset of the data
    nbytes: int


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, Any]  # python scalars, lists, strings
    tensors: dict[str, mx.array]  # mx.load output (quantized triples kept)
    infos: dict[str, TensorInfo] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


class _NeedMore(Exception):
    """The header runs past the bytes read so far."""


class _Cursor:
    """Bounds-checked little-endian reader over the file bytes."""

    def __init__(self, buf: bytes, path: Path, size: int):
        self.buf, self.pos, self.path, self.size = memoryview(buf), 0, path, size

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > self.size:
            raise MlxkvError(f"truncated or corrupt GGUF header: {self.path}")
        if self.pos + n > len(self.buf):
            raise _NeedMore()
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        return struct.unpack("<" + fmt, self.take(size))[0]

    def string(self) -> str:
        return bytes(self.take(self.unpack("Q"))).decode("utf-8", "replace")

    def skip_value(self, vtype: int) -> None:
        if vtype == 8:
            self.take(self.unpack("Q"))
        elif vtype == 9:
            etype, count = self.unpack("I"), self.unpack("Q")
            if etype == 8:
                for _ in range(count):
                    self.take(self.unpack("Q"))
            elif etype in _SCALAR:
                self.take(count * struct.calcsize(_SCALAR[etype]))
            else:
                raise MlxkvError(f"corrupt GGUF metadata (array type {etype}): {self.path}")
        elif vtype in _SCALAR:
            self.take(struct.calcsize(_SCALAR[vtype]))
        else:
            raise MlxkvError(f"corrupt GGUF metadata (value type {vtype}): {self.path}")


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Walk the header; check magic, version, tensor types and file length."""
    with open(path, "rb") as f:
        head = f.read(4)
        if head != b"GGUF":
            raise MlxkvError(f"not a GGUF file (bad magic {head!r}): {path}")
        f.seek(0, 2)
        size = f.tell()
    if size == 0:
        raise MlxkvError(f"not a GGUF file (empty): {path}")
    chunk = 1 << 22  # the header holds the vocabulary: grow the read until it parses
    while True:
        with open(path, "rb") as f:
            buf = f.read(min(chunk, size))
        try:
            return _parse(buf, path, size)
        except _NeedMore:
            chunk *= 4


MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ELEMENTS = 2**62  # a tensor's element count must stay well inside int64


def _parse(buf: bytes, path: Path, size: int) -> dict[str, TensorInfo]:
    c = _Cursor(buf, path, size)
    c.take(4)
    version = c.unpack("I")
    if version not in (2, 3):
        raise MlxkvError(f"unsupported GGUF version {version}: {path}")
    n_tensors, n_kv = c.unpack("Q"), c.unpack("Q")
    # every tensor entry takes >= 24 header bytes, every metadata entry >= 12: counts beyond that lie
    if n_tensors * 24 + n_kv * 12 > size:
        raise MlxkvError(f"corrupt GGUF header: it claims {n_tensors} tensors and {n_kv} metadata entries, more "
                         f"than {size} bytes can hold: {path}")
    if n_tensors == 0:
        raise MlxkvError(f"GGUF holds no tensors: {path}")
    alignment = 32
    for _ in range(n_kv):
        key, vtype = c.string(), c.unpack("I")
        if key == "general.alignment":
            if vtype != 4:
                raise MlxkvError(f"corrupt GGUF metadata: general.alignment must be a uint32 (type 4), not type "
                                 f"{vtype}: {path}")
            alignment = c.unpack("I")
            if alignment == 0 or alignment & (alignment - 1):
                raise MlxkvError(f"corrupt GGUF metadata: general.alignment {alignment} is not a power of two: "
                                 f"{path}")
        else:
            c.skip_value(vtype)
    raw, seen = [], set()
    for _ in range(n_tensors):
        name, ndim = c.string(), c.unpack("I")
        if not 1 <= ndim <= MAX_DIMS:
            raise MlxkvError(f"corrupt GGUF: tensor '{name}' has {ndim} dimensions (1 to {MAX_DIMS}): {path}")
        dims = [c.unpack("Q") for _ in range(ndim)]
        if name in seen:
            raise MlxkvError(f"corrupt GGUF: tensor '{name}' appears twice: {path}")
        seen.add(name)
        raw.append((name, tuple(reversed(dims)), c.unpack("I"), c.unpack("Q")))
    data_start = -(-c.pos // alignment) * alignment
    infos = {}
    for name, shape, tid, off in raw:
        if tid not in GGML_TYPES:
            raise MlxkvError(f"unsupported tensor type id {tid} for tensor '{name}': {path}")
        tname, block, block_bytes = GGML_TYPES[tid]
        if min(shape) < 1 or math.prod(shape) > MAX_ELEMENTS:
            raise MlxkvError(f"corrupt GGUF: tensor '{name}' has shape {list(shape)}: {path}")
        if shape[-1] % block and tname in SUPPORTED:  # (unsupported types are refused by name: check_types)
            raise MlxkvError(f"corrupt GGUF: tensor '{name}' ({tname}) has rows of {shape[-1]} elements, not a "
                             f"multiple of its {block}-element blocks: {path}")
        if off % alignment:
            raise MlxkvError(f"corrupt GGUF: tensor '{name}' data offset {off} is not a multiple of the alignment "
                             f"{alignment}: {path}")
        nbytes = math.prod(shape) // block * block_bytes
        start = data_start + off
        if start + nbytes > size:
            raise MlxkvError(
                f"truncated GGUF: tensor '{name}' extends past the end of {path} "
                f"(incomplete download?)")
        infos[name] = TensorInfo(name, shape, tname, start, nbytes)
    ordered = sorted(infos.values(), key=lambda i: i.offset)
    for a, b in zip(ordered, ordered[1:]):
        if b.offset < a.offset + a.nbytes:
            raise MlxkvError(f"corrupt GGUF: tensors '{a.name}' and '{b.name}' overlap in the file: {path}")
    return infos


def _to_python(v: Any) -> Any:
    if isinstance(v, mx.array):
        return v.item() if v.ndim == 0 else v.tolist()
    return v


def check_types(infos: dict[str, TensorInfo], path: Path) -> None:
    bad = [i for i in infos.values() if i.type_name not in SUPPORTED]
    if bad:
        kinds = sorted({i.type_name for i in bad})
        raise MlxkvError(
            f"unsupported tensor type {bad[0].type_name} for tensor '{bad[0].name}' "
            f"({len(bad)} tensors of type {'/'.join(kinds)}; supported: "
            f"{', '.join(sorted(SUPPORTED))}): {path}")


def read_gguf(path: str | Path) -> GGUFFile:
    """Validate and load a GGUF file (raises MlxkvError, one line)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise MlxkvError(f"GGUF file not found: {path}")
    if not path.is_file():
        raise MlxkvError(f"not a file: {path}")
    infos = read_header(path)
    check_types(infos, path)
    try:
        tensors, meta = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError) as e:
        raise MlxkvError(f"corrupt GGUF {path}: {first_line(e, None)}") from None
    for info in infos.values():
        if info.type_name in REDECODED:
            _redecode(path, info, tensors)
    metadata = {k: _to_python(v) for k, v in meta.items()}
    return GGUFFile(path, metadata, tensors, infos)


def _redecode(path: Path, info: TensorInfo, tensors: dict[str, mx.array]) -> None:
    """Replace mx.load's float16 decode of a BF16 / Q4_K / Q6_K tensor with an exact one."""
    raw = np.fromfile(path, np.uint8, info.nbytes, offset=info.offset)
    if info.type_name == "BF16":
        tensors[info.name] = mx.array(raw.view(np.uint16)).view(mx.bfloat16).reshape(info.shape)
    elif info.type_name == "Q6_K":
        tensors[info.name] = mx.array(kquants.q6_k_dense(raw, info.shape))
    elif info.type_name == "Q4_K":
        if len(info.shape) != 2 or not info.name.endswith(".weight"):
            raise MlxkvError(f"unsupported Q4_K tensor '{info.name}' {info.shape}: {path}")
        w, scales, biases = kquants.q4_k_affine(raw, info.shape)
        base = info.name[: -len(".weight")]
        tensors[info.name] = mx.array(w)
        tensors[base + ".scales"] = mx.array(scales)
        tensors[base + ".biases"] = mx.array(biases)
