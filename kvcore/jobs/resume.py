"""`generate --load-cache / --save-cache`: start a run from a saved cache, save one after it.

Under several ranks each rank saves and opens its own file (its KV heads), named by `rank_path`.
mlx-lm's own prompt-cache files are converted on load (store/mlx_lm_load.py): they hold no token
ids, so only a raw continuation follows them, and their model check is weaker (a notice says both).
The loaded cache keeps the KV policy it was saved with (flags that ask for another one get a
note). Its tokens are reused as far as they agree with the new context; where rolling back
is impossible (a wrapped sliding window, SSM state) the context is prefilled from scratch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..engine.forward import cache_offset
from ..engine.reuse import reuse_prefix
from ..errors import MlxkvError
from ..policy import KVPolicy, LayerPlan, plan_layers
from ..store import (
    CacheFile,
    Sharding,
    check_fingerprint,
    check_sharding,
    local_kv_heads,
    model_fingerprint,
    open_cache_file,
    rank_path,
    save_cache,
)
from ..store.mlx_lm_load import UNKNOWN, MlxLmCache, is_mlx_lm_cache, open_mlx_lm_cache


@dataclass
class CacheStart:
    caches: list
    plan: list[LayerPlan]
    prefill: list[int]  # context tokens still to feed
    compresses: bool
    kv_policy: dict  # for the run summary


def run_sharding(lm, ranks: int, rank: int) -> Sharding:
    """This rank's layout, as a cache file records it."""
    return Sharding() if ranks == 1 else Sharding(ranks, rank, local_kv_heads(lm.model))


def open_for_model(path: str | Path, lm, sharding: Sharding = Sharding()) -> CacheFile:
    """Open and check this rank's file of the cache `path`; refuse one made for another model or
    tokenizer, or for another rank layout."""
    if is_mlx_lm_cache(path):
        return open_mlx_lm_cache(path, lm, sharding)
    mine = rank_path(path, sharding.rank, sharding.ranks)
    if mine != Path(path) and not mine.exists():
        raise MlxkvError(f"cannot continue from {path}: rank {sharding.rank}'s file {mine} not found (a cache saved "
                         f"under {sharding.ranks} ranks has one file per rank, beside rank 0's)")
    cf = open_cache_file(mine)
    try:
        check_fingerprint(cf.fingerprint, model_fingerprint(lm.model, lm.tokenizer, lm.config))
        check_sharding(cf.sharding, sharding)
    except MlxkvError as e:
        raise MlxkvError(f"cannot continue from {mine}: {e}") from None
    return cf


def _label(plan: list[LayerPlan]) -> str:
    codecs = {p.label() for p in plan if p.compresses}
    windows = sorted({p.window for p in plan if p.window})
    codec = "full" if not codecs else codecs.pop() if len(codecs) == 1 else "per-layer codecs"
    return codec + (f", windows {', '.join(map(str, windows))}" if windows else "")


def _same(a: list[LayerPlan], b: list[LayerPlan]) -> bool:
    key = lambda p: (p.kind, p.codec, p.values, p.recent, p.window, p.keep)  # noqa: E731
    return len(a) == len(b) and all(key(x) == key(y) for x, y in zip(a, b))


def start_from_cache(cf: CacheFile, context: list[int], model, asked: KVPolicy | None,
                     note: Callable[[str], None]) -> CacheStart:
    """Caches holding as much of `context` as the file allows, and what is left to prefill.

    `asked`: the policy the user's KV flags give (None when no KV flag was given)."""
    if isinstance(cf, MlxLmCache):
        if context[: len(cf.prefix_ids)] != cf.prefix_ids:
            raise MlxkvError(f"{cf.path} is an mlx-lm prompt cache: it holds no token ids, so a prompt cannot be "
                             f"matched against it; continue it with -p (text after the cached tokens), not "
                             f"--prompt-file")
        if len(context) == len(cf.prefix_ids):
            raise MlxkvError(f"{cf.path} is an mlx-lm prompt cache: give -p text to continue with (its last token "
                             f"cannot be fed again: its id is unknown)")
        note(cf.notice)
    plan = cf.plan()
    if asked is not None:
        wanted = plan_layers(model, asked)
        if not _same(plan, wanted):
            note(f"using the cache's KV policy ({_label(plan)}); the KV flags asked for {_label(wanted)}")
    caches = cf.restore()
    reuse = reuse_prefix(caches, cf.prefix_ids, context)
    if reuse.blocked:
        note(f"cannot reuse the cached tokens ({reuse.blocked}): prefilling all {len(context)} tokens")
        caches = cf.fresh()
    elif reuse.kept < len(cf.prefix_ids):
        note(f"the prompt diverges from the cache after {reuse.kept} of its {len(cf.prefix_ids)} tokens: "
             f"reusing {reuse.kept}")
    starts = [p.start for p in plan if p.compresses and p.start is not None]
    kv_policy = {"source": f"cache {cf.path}", "codec": _label(plan), "start": min(starts, default=None),
                 "max_kv_size": None, "reused_tokens": reuse.kept}
    return CacheStart(caches, plan, context[reuse.kept:], any(p.compresses for p in plan), kv_policy)


def save_after_run(path: str | Path, lm, caches: list, context: list[int], completion,
                   sharding: Sharding = Sharding()) -> tuple[Path, int]:
    """Save `caches` after a run over `context` to this rank's file of `path`; they hold its tokens
    and the generated ones fed back (every one but a last token that hit --max-tokens).
    Returns the file written and its size."""
    if UNKNOWN in context:
        raise MlxkvError("cannot save the caches: they continue an mlx-lm prompt cache, whose token ids are unknown "
                         "(an mlxkv cache file records them)")
    fed = context + completion.token_ids + ([completion.eos_token] if completion.eos_token is not None else [])
    n = cache_offset(caches)
    if n > len(fed):
        raise MlxkvError(f"internal: the caches hold {n} tokens, the run produced {len(fed)}")
    mine = rank_path(path, sharding.rank, sharding.ranks)
    fp = model_fingerprint(lm.model, lm.tokenizer, lm.config)
    return mine, save_cache(mine, caches, fed[:n], fp, sharding)
