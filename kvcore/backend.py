"""Which MLX backend runs, and the versions that go into reports."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from functools import lru_cache

import mlx.core as mx

from .errors import first_line


def backend_name() -> str:
    """'cpu' | 'cuda' | 'metal': where arrays run by default (asked on every call: tests move it)."""
    return _backend(mx.default_device() == mx.cpu)


@lru_cache(maxsize=None)
def _backend(cpu: bool) -> str:
    if cpu:
        return "cpu"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return "metal"


def versions() -> dict:
    import mlx_lm

    from . import __version__

    return {"mlxkv": __version__, "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__}


def failure(e: Exception) -> str:
    """An exception as one line of a verdict: its type and the first 200 characters of its message."""
    line = first_line(e, empty="")
    return f"{type(e).__name__}: {line}" if line else type(e).__name__


@contextmanager
def cpu_reference():
    """The CPU stream with compilation off, for a device check's one-off reference: it builds no kernels (run 13's
    first turbo prompt spent 34 of its 55 s building the portable encode's fused CUDA kernel for its check) and
    needs no C++ compiler (MLX compiles CPU graphs with g++)."""
    mx.disable_compile()
    try:
        with mx.stream(mx.cpu):
            yield
    finally:
        if not os.environ.get("MLX_DISABLE_COMPILE"):
            mx.enable_compile()


CHECKS: list = []  # (what, key, seconds): every admission check this process ran (builds included), in order


def timed_check(what: str, key, check):
    """check() (None or why not), its seconds appended to CHECKS: a first prompt's cost, named piece by piece."""
    t0 = time.perf_counter()
    try:
        return check()
    finally:
        CHECKS.append((what, key, round(time.perf_counter() - t0, 3)))


def checks_since(seen: int) -> list:
    """The checks run since CHECKS held `seen` of them, as [what, key text, seconds] (JSON-ready)."""
    return [[what, str(key), s] for what, key, s in CHECKS[seen:]]


class Verdicts(dict):
    """Device launches' admissions, each key checked once: None (admitted) or why not. A check that
    raises (a kernel that cannot build or run here) refuses, naming its error; the portable path serves."""

    def __init__(self, what: str = ""):
        super().__init__()
        self.what = what  # names its checks in CHECKS

    def admitted(self, key, check, label=None) -> bool:
        """`label`: the check's name in CHECKS where the key's own text would not read (default: the key)."""
        if key not in self:
            try:
                self[key] = timed_check(self.what, key if label is None else label, check)
            except Exception as e:  # noqa: BLE001 - a refusal, not a crash
                self[key] = failure(e)
        return self[key] is None


# MLX's CUDA allocator serves arrays of 8 bytes or less from one managed pool that the host writes into
# whenever Python makes a scalar (many times a step), so a kernel reading one takes a page fault (run 14:
# most of the decode kernel's fixed ~33 us a launch). The small inputs the kernels read (the decode launch's
# dims, scale and slot; a 1-bit codebook, its one boundary) are therefore whole pages of their own, made once.
POOL_BYTES = 8
PAGE_BYTES = 4096  # the unit managed memory is resident in on x86; run 15 measured the fix with 64 KiB arrays
_UNPOOLED: dict[int, tuple[mx.array, mx.array]] = {}


def paged(values: tuple, dtype) -> mx.array:
    """`values` at the front of a page-sized array (kernels read only those)."""
    return mx.array(list(values) + [0] * (PAGE_BYTES // dtype.size - len(values)), dtype=dtype)


def unpooled(a: mx.array) -> mx.array:
    """`a` if it is bigger than the pool's blocks, else a copy padded with zeros to a page, made once per
    array (`a` is kept alive beside it, so its id is not reused)."""
    if a.nbytes > POOL_BYTES:
        return a
    hit = _UNPOOLED.get(id(a))
    if hit is None:
        pad = mx.zeros((PAGE_BYTES // a.itemsize - a.size,), dtype=a.dtype)
        hit = _UNPOOLED[id(a)] = (a, mx.concatenate([a.reshape(-1), pad]))
    return hit[1]
