"""A minimal GGUF v3 writer with Q8_0 / Q4_0 / Q4_1 / F16 / F32 tensors.

mx.save_gguf only writes dense tensors (F32/F16/I8..I32); this writes the
quantized block types llama.cpp uses, so tests can build quantized GGUFs
without llama.cpp. Encoders follow ggml's reference `quantize_row_*_ref`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvcore.gguf.reader import GGML_TYPES

_TYPE_IDS = {name: tid for tid, (name, _, _) in GGML_TYPES.items()}


@dataclass
class RawTensor:
    """Already-encoded tensor data of any ggml type (e.g. random Q4_K blocks)."""

    type_name: str
    shape: tuple[int, ...]  # MLX order (rows, cols)
    data: bytes


def _blocks(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float32)
    if x.shape[-1] % 32:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of 32")
    return x.reshape(-1, 32)  # (n_blocks, 32)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    # q: (n_blocks, 32) in [0, 15] -> (n_blocks, 16): low nibble j, high nibble j + 16
    q = q.astype(np.uint8)
    return q[:, :16] | (q[:, 16:] << 4)


def quantize_q8_0(x: np.ndarray) -> RawTensor:
    b = _blocks(x)
    d = np.abs(b).max(axis=1) / 127.0
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    q = np.trunc(b * inv[:, None] + np.copysign(0.5, b)).astype(np.int8)  # roundf
    rec = np.zeros(len(b), dtype=[("d", "<f2"), ("q", "i1", 32)])
    rec["d"], rec["q"] = d, q
    return RawTensor("Q8_0", tuple(np.shape(x)), rec.tobytes())


def quantize_q4_0(x: np.ndarray) -> RawTensor:
    b = _blocks(x)
    idx = np.abs(b).argmax(axis=1)
    d = b[np.arange(len(b)), idx] / -8.0  # signed max maps to -8
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    q = np.minimum(15, np.trunc(b * inv[:, None] + 8.5)).astype(np.int32)
    rec = np.zeros(len(b), dtype=[("d", "<f2"), ("qs", "u1", 16)])
    rec["d"], rec["qs"] = d, _pack_nibbles(q)
    return RawTensor("Q4_0", tuple(np.shape(x)), rec.tobytes())


def quantize_q4_1(x: np.ndarray) -> RawTensor:
    b = _blocks(x)
    lo, hi = b.min(axis=1), b.max(axis=1)
    d = (hi - lo) / 15.0
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    q = np.minimum(15, np.trunc((b - lo[:, None]) * inv[:, None] + 0.5)).astype(np.int32)
    rec = np.zeros(len(b), dtype=[("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)])
    rec["d"], rec["m"], rec["qs"] = d, lo, _pack_nibbles(q)
    return RawTensor("Q4_1", tuple(np.shape(x)), rec.tobytes())


def dequantize(t: RawTensor) -> np.ndarray:
    """Reference decode of the block types above (float32, MLX shape)."""
    raw = np.frombuffer(t.data, np.uint8)
    if t.type_name in ("F32", "F16"):
        dt = "<f4" if t.type_name == "F32" else "<f2"
        return raw.view(dt).astype(np.float32).reshape(t.shape)
    if t.type_name == "Q8_0":
        rec = raw.view([("d", "<f2"), ("q", "i1", 32)])
        x = rec["d"].astype(np.float32)[:, None] * rec["q"]
    else:
        fields = [("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)] if t.type_name == "Q4_1" \
            else [("d", "<f2"), ("qs", "u1", 16)]
        rec = raw.view(fields)
        q = np.concatenate([rec["qs"] & 15, rec["qs"] >> 4], axis=1).astype(np.float32)
        d = rec["d"].astype(np.float32)[:, None]
        x = q * d + rec["m"].astype(np.float32)[:, None] if t.type_name == "Q4_1" else (q - 8) * d
    return x.reshape(t.shape)


def dense(x: np.ndarray, type_name: str = "F32") -> RawTensor:
    dt = "<f4" if type_name == "F32" else "<f2"
    return RawTensor(type_name, tuple(np.shape(x)), np.ascontiguousarray(x, dt).tobytes())


def _str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _value(v: Any) -> bytes:
    """type id + payload for a metadata value."""
    if isinstance(v, str):
        return struct.pack("<I", 8) + _str(v)
    if isinstance(v, (bool, np.bool_)):
        return struct.pack("<I?", 7, bool(v))
    if isinstance(v, (int, np.integer)):
        return struct.pack("<Ii", 5, int(v)) if v < 0 else struct.pack("<II", 4, int(v))
    if isinstance(v, (float, np.floating)):
        return struct.pack("<If", 6, float(v))
    items = list(v)
    if all(isinstance(i, str) for i in items):
        return struct.pack("<IIQ", 9, 8, len(items)) + b"".join(_str(i) for i in items)
    arr = np.asarray(items)
    if np.issubdtype(arr.dtype, np.floating):
        return struct.pack("<IIQ", 9, 6, len(arr)) + arr.astype("<f4").tobytes()
    return struct.pack("<IIQ", 9, 5, len(arr)) + arr.astype("<i4").tobytes()


def write_gguf(path: str | Path, metadata: dict[str, Any],
               tensors: dict[str, RawTensor | np.ndarray], alignment: int = 32) -> Path:
    """Write a GGUF v3 file; numpy arrays are stored as F32."""
    raws = {k: v if isinstance(v, RawTensor) else dense(v) for k, v in tensors.items()}
    head = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(raws), len(metadata)))
    for key, v in metadata.items():
        head += _str(key) + _value(v)
    offset, layout = 0, []
    for name, t in raws.items():
        offset = -(-offset // alignment) * alignment
        dims = b"".join(struct.pack("<Q", d) for d in reversed(t.shape))
        head += _str(name) + struct.pack("<I", len(t.shape)) + dims
        head += struct.pack("<IQ", _TYPE_IDS[t.type_name], offset)
        layout.append((offset, t.data))
        offset += len(t.data)
    head += b"\0" * (-len(head) % alignment)
    body = bytearray()
    for off, data in layout:
        body += b"\0" * (off - len(body)) + data
    path = Path(path)
    path.write_bytes(bytes(head) + bytes(body))
    return path
