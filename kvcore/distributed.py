"""Multi-process runs on MLX's distributed backends (ring, MPI, NCCL), launched by mlx.launch.

Each rank loads the model and keeps its tensor-parallel shard (mlx-lm's `model.shard(group)`),
so each rank's caches hold its own KV heads in the chosen compressed form (and a saved cache is
one file per rank, see store/sharding.py). Before any work the
ranks shake hands: every rank says whether its setup succeeded and a hash of its settings; a
failed rank or mismatched settings end every rank with one message, and a watchdog bounds the
wait so a rank that never arrives cannot hang the others. Steps that may fail on one rank only
(opening or saving its cache file) end the same way, through `on_every_rank`.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, TypeVar

import mlx.core as mx
import mlx.nn as nn

from .errors import MlxkvError

TIMEOUT_S = float(os.environ.get("MLXKV_DIST_TIMEOUT", "120"))
T = TypeVar("T")


@dataclass(frozen=True)
class Dist:
    group: object
    rank: int
    size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched() -> bool:
    """Whether a launcher (mlx.launch, mpirun) started this process as one of several ranks."""
    return "MLX_RANK" in os.environ or "OMPI_COMM_WORLD_SIZE" in os.environ


def current() -> Dist:
    if not launched():
        return Dist(None, 0, 1)
    g = mx.distributed.init()
    return Dist(g if g.size() > 1 else None, g.rank(), g.size())


@contextmanager
def watchdog(dist: Dist, what: str, timeout: float = TIMEOUT_S):
    """Exit this rank with one line if `what` has not finished within `timeout` seconds."""
    def expire():
        print(f"error: rank {dist.rank}: no answer from the other ranks within {timeout:.0f} s while {what} "
              "(a rank failed to start, or the launch is inconsistent)", file=sys.stderr, flush=True)
        os._exit(1)

    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:3], "little")


def _exchange(dist: Dist, ok: bool, key: str, what: str) -> tuple[list[int], list[int]]:
    """Every rank's (ok, key digest), bounded by the watchdog: (failed ranks, ranks whose key differs
    from rank 0's among those that did not fail)."""
    with watchdog(dist, what):
        mine = mx.array([[1 if ok else 0, _digest(key)]], dtype=mx.int32)
        every = mx.distributed.all_gather(mine, group=dist.group).tolist()
    failed = [r for r, (good, _) in enumerate(every) if not good]
    differ = [r for r, (good, d) in enumerate(every) if good and d != every[0][1]]
    return failed, differ


def handshake(dist: Dist, ok: bool, settings: str) -> None:
    """All ranks agree that setup succeeded and that they run the same settings."""
    if dist.size == 1:
        return
    failed, differ = _exchange(dist, ok, settings, "checking that every rank is ready")
    if failed:
        raise MlxkvError(f"rank {failed[0]} failed during setup (see its message); all ranks stop")
    if differ:
        raise MlxkvError(f"rank {differ[0]} runs different settings than rank 0 (model, KV flags or prompts)")


def on_every_rank(dist: Dist, what: str, step: Callable[[], T], key: Callable[[T], str] | None = None,
                  differ: str = "rank {rank} disagrees with rank 0") -> T:
    """Run `step` on this rank, then agree: a rank that failed (its own error raised there) or whose
    key(result) differs from rank 0's ends every rank with one line, instead of leaving the others
    waiting in a collective. `differ` is the message for a differing key ({rank} is filled in)."""
    if dist.size == 1:
        return step()
    try:
        result = step()
    except Exception:
        _exchange(dist, False, "", what)  # tell the others, then report this rank's own error
        raise
    failed, differing = _exchange(dist, True, key(result) if key else "", what)
    if failed:
        raise MlxkvError(f"rank {failed[0]} failed while {what} (see its message); all ranks stop")
    if differing:
        raise MlxkvError(differ.format(rank=differing[0]))
    return result


def shard(model: nn.Module, dist: Dist) -> None:
    """Tensor-parallel: keep this rank's shard of every layer (mlx-lm's own `shard`)."""
    if dist.size == 1:
        return
    inner = getattr(model, "shard", None)
    if inner is None:
        raise MlxkvError(f"{type(model).__module__} has no tensor-parallel support in mlx-lm (no shard())")
    with watchdog(dist, "sharding the model"):
        inner(dist.group)


def load_for_run(ref: str | None, dtype: str | None, settings: str, extra_eos: tuple[str, ...] = ()):
    """Load the model (`extra_eos`: more tokens that end a row, as mlx-lm's --extra-eos-token), keep this
    rank's shard, and shake hands; returns (LoadedModel, Dist)."""
    from .models import load_model

    dist = current()
    try:
        lm = load_model(ref, dtype, extra_eos)
        shard(lm.model, dist)
    except MlxkvError:
        if dist.size > 1:  # tell the others, so they stop instead of waiting
            try:
                handshake(dist, False, settings)
            except MlxkvError:
                pass
        raise
    handshake(dist, True, settings)
    return lm, dist
