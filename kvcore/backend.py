"""Which MLX backend runs, and the versions that go into reports."""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx


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
