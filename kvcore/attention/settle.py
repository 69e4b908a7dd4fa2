"""Layer by layer under a memory bound: each attention call of a bounded prefill starts from a settled graph.

MLX's memory limit (`kvcore.transient.memory_limit`) makes its graph walk wait for work in flight once active
memory is over the limit, but on CUDA it only waits on command graphs that were committed because they grew
full (100 ops or 1 000 MB of inputs on Hopper: `mlx/backend/cuda/device.cpp`, `get_graph_limits`), and an open
graph keeps every input of its ops alive until it finishes. So a chunk's open graph held several layers'
transients beyond the plan: the H200's P8 trace (run 20e, 4-bit llama-8b, 10 GiB budget) put every 2 048-token
chunk ~0.9 GB above the plan's one-layer transient, at 2k tokens of context as at 126k. Metal commits its
command buffers after a few dozen ops and counts each one, and the CPU counts every task, so the bound holds
there as it is.

Inside a bounded block (`bounded`, entered by `memory_limit`) the attention hook (`attention/hook.py`) calls
`settle(queries)` first: the graph up to this layer's queries (the previous layer whole) is evaluated, so what
is in flight is one layer's attention and what follows it, as the plan counts. It costs one host wait a layer
and chunk, while the GPU waits for the host to hand the next layer over. Run 21 (H200): the 4-bit llama-8b at 128k
under 10 GiB peaked at 10.33 GB (the plan: 10.35; before, 11.38), the bf16 one under its plan at 21.97 GB
(before, 22.61) at 6% less prefill speed (10 588 against 11 273 tok/s).

`MLXKV_LAYER_SYNC`: `auto` (the default) settles on CUDA only, `1` on every backend (tests), `0` never.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import mlx.core as mx

_STATE = {"depth": 0, "settled": 0}


def mode() -> str:
    v = os.environ.get("MLXKV_LAYER_SYNC", "auto")
    return v if v in ("0", "1") else "auto"


def active() -> bool:
    """Whether attention calls settle now: inside a bounded block, on the backends `mode` names."""
    if _STATE["depth"] == 0:
        return False
    m = mode()
    if m != "auto":
        return m == "1"
    from ..backend import backend_name

    return backend_name() == "cuda"


@contextmanager
def bounded():
    """Attention calls inside this block settle first (where `active`); blocks nest."""
    _STATE["depth"] += 1
    try:
        yield
    finally:
        _STATE["depth"] -= 1


def settle(x: mx.array) -> None:
    """Evaluate `x` (and everything it depends on) now, where `active`; count it."""
    if active():
        mx.eval(x)
        _STATE["settled"] += 1


def settled() -> int:
    """How many calls have settled in this process (tests count them)."""
    return _STATE["settled"]
