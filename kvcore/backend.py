"""Which MLX backend runs, and the versions that go into reports."""

from __future__ import annotations

import mlx.core as mx


def backend_name() -> str:
    if mx.default_device() == mx.cpu:
        return "cpu"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return "metal"


def versions() -> dict:
    import mlx_lm

    from . import __version__

    return {"mlxkv": __version__, "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__}
