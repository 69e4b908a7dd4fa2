"""Route a model's attention through kvcore whenever it is handed mlxkv's caches.

mlx-lm has no attention hook: its model files import `scaled_dot_product_attention` from
`mlx_lm.models.base`, which switches on `cache.bits`. So the name is rebound, once and for
good, in `mlx_lm.models.base` (modules imported later pick it up) and in every model module
already imported (`install`, run whenever an mlxkv cache is built; idempotent and cheap), and
in the modules of a given model's classes (`bind`, for models defined outside mlx-lm).
Dense keys go to mlx-lm's own function unchanged, so models with mlx-lm's caches behave as
before; a view of an mlxkv cache goes to the portable path, with the config it carries, and
its cache set's counters count the call. No context manager is needed.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import mlx.nn as nn
from mlx_lm.models import base as mlx_base

from ..cache.packed import PackedView
from ..cache.paged import PagedView
from ..cache.view import BatchKVView, KVView
from ..errors import MlxkvError
from . import dense_fold, settle
from .blockwise import batch_kv_attention, kv_attention, packed_attention
from .config import AttentionStats
from .paged import paged_attention
from .rotated import in_rotated_basis

_ORIGINAL = mlx_base.scaled_dot_product_attention
_VIEWS = ((KVView, kv_attention), (PackedView, packed_attention), (PagedView, paged_attention),
          (BatchKVView, batch_kv_attention))
_SEEN = {"modules": -1}


def _sdpa(queries, keys, values, cache, scale, mask, sinks=None):
    settle.settle(queries)  # inside a bounded prefill on CUDA: the layers before this one finish first (settle.py)
    launch = getattr(keys, "launch", None)  # a steady compressed layer whose cache kept its kernel launch
    if launch is not None:
        out = launch(queries, keys, scale, sinks)
        if out is not None:
            return out
    for kind, attend in _VIEWS:
        if isinstance(keys, kind):
            return in_rotated_basis(attend, queries, keys, scale, sinks)
    stats = getattr(cache, "stats", None)
    if isinstance(stats, AttentionStats):
        stats.dense_calls += 1
    if dense_fold.applies(queries, keys, mask, sinks, cache):
        if isinstance(stats, AttentionStats):
            stats.folded += 1
        return dense_fold.attention(queries, keys, values, scale, mask, cache)
    return _ORIGINAL(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)


def _patch(name: str) -> bool:
    mod = sys.modules.get(name)
    attr = getattr(mod, "scaled_dot_product_attention", None) if mod is not None else None
    if attr is _ORIGINAL:
        mod.scaled_dot_product_attention = _sdpa
    return attr in (_ORIGINAL, _sdpa)


def install() -> None:
    """Rebind the name in mlx-lm's base and in every imported mlx-lm model module (idempotent)."""
    if _SEEN["modules"] == len(sys.modules):
        return
    for name in [n for n in list(sys.modules) if n.startswith("mlx_lm.models.")]:
        _patch(name)
    _SEEN["modules"] = len(sys.modules)


def bind(model: nn.Module, required: bool = True) -> list[str]:
    """Install, and rebind the name in the modules the model's classes live in; returns them.
    With `required`, a model that does not attend through mlx-lm's function is a one-line error."""
    install()
    names = sorted({type(m).__module__ for _, m in model.named_modules()})
    attending = [n for n in names if _patch(n)]
    if required and not attending:
        raise MlxkvError(
            f"model class {type(model).__module__} does not attend through "
            "mlx_lm.models.base.scaled_dot_product_attention; compressed KV is not supported for it"
        )
    return attending


def attention_stats(caches: list) -> AttentionStats:
    """The counters of the cache set `caches` (empty ones when it holds no mlxkv cache)."""
    for c in caches:
        stats = getattr(c, "stats", None)
        if isinstance(stats, AttentionStats):
            return stats
    return AttentionStats()


@contextmanager
def attention_context(model: nn.Module, required: bool = True):
    """Kept for callers of earlier versions: binds the model (no longer needed) and yields nothing."""
    bind(model, required)
    yield None
