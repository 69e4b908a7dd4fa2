"""The safetensors container, read and checked by hand before `mx.load` sees the file.

```
bytes 0..8      little-endian u64: header length n
bytes 8..8+n    JSON: {"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets"}, ...}
bytes 8+n..     the arrays, back to back, at their data_offsets
```
Every failure is a `CacheFileError` naming what is wrong; nothing here trusts the file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from ..errors import MlxkvError, first_line

MAX_HEADER = 100 * 2**20
READ_CHUNK = 4 * 2**20

# safetensors dtype code -> (mlx dtype name, bytes per element)
DTYPES = {
    "BOOL": ("bool", 1), "U8": ("uint8", 1), "I8": ("int8", 1), "U16": ("uint16", 2), "I16": ("int16", 2),
    "U32": ("uint32", 4), "I32": ("int32", 4), "U64": ("uint64", 8), "I64": ("int64", 8),
    "F16": ("float16", 2), "BF16": ("bfloat16", 2), "F32": ("float32", 4),
}


class CacheFileError(MlxkvError):
    """A cache file that cannot be read: one line naming the file and the problem."""


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str  # mlx dtype name
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass
class Container:
    path: Path
    size: int
    metadata: dict[str, str]
    tensors: dict[str, Tensor]

    def fail(self, msg: str) -> CacheFileError:
        return CacheFileError(f"cache file {self.path}: {msg}")

    def read(self, t: Tensor) -> bytes:
        with open_regular(self.path) as f:
            f.seek(t.begin)
            data = f.read(t.nbytes)
        if len(data) != t.nbytes:
            raise self.fail(f"array {t.name!r} is cut short (file changed while reading?)")
        return data

    def sha256(self, t: Tensor) -> str:
        h = hashlib.sha256()
        with open_regular(self.path) as f:
            f.seek(t.begin)
            left = t.nbytes
            while left:
                chunk = f.read(min(left, READ_CHUNK))
                if not chunk:
                    raise self.fail(f"array {t.name!r} is cut short (file changed while reading?)")
                h.update(chunk)
                left -= len(chunk)
        return h.hexdigest()

    def load_arrays(self) -> dict[str, mx.array]:
        """The arrays, by mx.load (lazy); its errors on a file changed since the checks are ours."""
        open_regular(self.path).close()  # mx.load opens the path again: still a regular file?
        try:
            arrays = mx.load(str(self.path), format="safetensors")
        except (RuntimeError, ValueError, OSError) as e:
            raise self.fail(f"cannot read the arrays ({first_line(e, limit=None)})")
        for name, t in self.tensors.items():
            a = arrays.get(name)
            if a is None or tuple(a.shape) != t.shape or dtype_name(a.dtype) != t.dtype:
                raise self.fail(f"array {name!r} changed while reading")
        return arrays


def _fail(path: Path, msg: str) -> CacheFileError:
    return CacheFileError(f"cache file {path}: {msg}")


_NOT_REGULAR = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def open_regular(path: Path):
    """`path` opened for reading if it is a regular file (checked on the open descriptor, so a FIFO
    or device is refused instead of blocking on open or read)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        raise CacheFileError(f"cache file not found: {path}")
    except OSError as e:
        raise CacheFileError(f"cannot read cache file {path}: {e.strerror or e}")
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        what = next((name for test, name in _NOT_REGULAR if test(mode)), "not a regular file")
        raise CacheFileError(f"cache file {path} is {what}, not a regular file")
    if hasattr(os, "set_blocking"):
        os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def open_container(path: str | Path) -> Container:
    """Check the container (header length, JSON, tensor table, data extent); read no array."""
    path = Path(path)
    try:
        with open_regular(path) as f:
            size = f.seek(0, 2)
            f.seek(0)
            head = f.read(8)
            if len(head) < 8:
                raise _fail(path, f"truncated: {size} bytes, not even a header length")
            (n,) = struct.unpack("<Q", head)
            if n < 2 or n > min(MAX_HEADER, size - 8):
                raise _fail(path, f"invalid header length {n} (file has {size} bytes; truncated or not safetensors)")
            raw = f.read(n)
    except OSError as e:
        raise CacheFileError(f"cannot read cache file {path}: {e.strerror or e}")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise _fail(path, "the header is not valid JSON (damaged or not safetensors)")
    if not isinstance(header, dict):
        raise _fail(path, "the header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata  # mlx writes null for "no metadata"
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _fail(path, "the header's __metadata__ is not a string table")
    tensors = _tensor_table(path, header, 8 + n, size)
    return Container(path, size, metadata, tensors)


def _tensor_table(path: Path, header: dict, data_start: int, size: int) -> dict[str, Tensor]:
    tensors, spans = {}, []
    for name, info in header.items():
        if not isinstance(info, dict):
            raise _fail(path, f"header entry {name!r} is not an object")
        code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(code, str) or code not in DTYPES:
            raise _fail(path, f"array {name!r} has an unknown dtype {code!r}")
        if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
            raise _fail(path, f"array {name!r} has an invalid shape {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(is_int(o) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise _fail(path, f"array {name!r} has invalid data offsets {offsets!r}")
        dtype, itemsize = DTYPES[code]
        if offsets[1] - offsets[0] != math.prod(shape) * itemsize:
            raise _fail(path, f"array {name!r}: shape {shape} does not match its {offsets[1] - offsets[0]} bytes")
        tensors[name] = Tensor(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])
        spans.append((offsets[0], offsets[1], name))
    end = 0
    for b, e, name in sorted(spans):
        if b != end:
            raise _fail(path, f"array {name!r} overlaps another or leaves a gap in the data")
        end = e
    if data_start + end != size:
        what = "truncated" if data_start + end > size else "has trailing bytes"
        raise _fail(path, f"{what}: the header describes {data_start + end} bytes, the file has {size}")
    return tensors


def array_sha256(a: mx.array) -> str:
    """sha256 of the bytes safetensors stores for `a` (row-major)."""
    a = mx.contiguous(a)
    mx.eval(a)
    view = memoryview(a)
    return hashlib.sha256(view if view.c_contiguous else view.tobytes()).hexdigest()
