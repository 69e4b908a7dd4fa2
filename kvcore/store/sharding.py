"""Which rank's KV heads a cache file holds, and whether this run can continue from it.

A run under mlx.launch with N tensor-parallel ranks saves N files, one per rank, each with its
own KV heads (mlx-lm's `model.shard` splits them evenly):
```
out.kv               rank 0 (the path given to --save-cache / --load-cache)
out.rank1-of-2.kv    rank 1, beside it (on rank 1's machine)
```
Each records `"sharding": {"ranks": N, "rank": r, "kv_heads": heads per rank}` in its header.
A file continues only on the same layout: same rank count, same rank, same heads per rank.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import MlxkvError
from .schema import Fields

HEAD_ATTRS = ("n_kv_heads", "num_key_value_heads", "num_kv_heads")  # names mlx-lm's attention modules use


@dataclass(frozen=True)
class Sharding:
    ranks: int = 1
    rank: int = 0
    kv_heads: int | None = None  # KV heads this rank holds per attention layer (None: unknown)

    @property
    def single(self) -> bool:
        return self.ranks == 1

    def describe(self) -> str:
        return "a single process" if self.single else f"rank {self.rank} of {self.ranks}"

    def to_json(self) -> dict:
        return {"ranks": self.ranks, "rank": self.rank, "kv_heads": self.kv_heads}


def read_sharding(f: Fields) -> Sharding:
    s = f.sub("sharding")
    ranks = s.int("ranks", lo=2, hi=4096)
    return Sharding(ranks, s.int("rank", hi=ranks - 1), s.int("kv_heads", lo=1, optional=True))


def local_kv_heads(model) -> int | None:
    """KV heads of this (possibly sharded) model's first attention layer, where mlx-lm names them."""
    for layer in getattr(model, "layers", None) or ():
        attn = getattr(layer, "self_attn", None) or getattr(layer, "attn", None)
        for name in HEAD_ATTRS:
            n = getattr(attn, name, None)
            if isinstance(n, int):
                return n
    return None


def rank_path(path: str | Path, rank: int, ranks: int) -> Path:
    """Rank `rank`'s file of the set named `path` (rank 0's, or a single process's, is `path` itself)."""
    path = Path(path)
    if ranks == 1 or rank == 0:
        return path
    return path.with_name(f"{path.stem}.rank{rank}-of-{ranks}{path.suffix}")


def set_paths(path: str | Path, sharding: Sharding) -> list[Path] | None:
    """Every rank's file of the set that `path` (this rank's file) belongs to, by name; None when the
    name does not follow `rank_path`."""
    path = Path(path)
    tag = f".rank{sharding.rank}-of-{sharding.ranks}"
    if sharding.rank and not path.stem.endswith(tag):
        return None
    base = path.with_name(path.stem[: len(path.stem) - len(tag)] + path.suffix) if sharding.rank else path
    return [rank_path(base, r, sharding.ranks) for r in range(sharding.ranks)]


def check_sharding(saved: Sharding, current: Sharding) -> None:
    """Raise one line naming how the file's layout differs from this rank's."""
    if saved.single and not current.single:
        raise MlxkvError(f"it was saved by a single process, this run has {current.ranks} ranks (continue it "
                         f"without mlx.launch, or save it again under {current.ranks} ranks)")
    if current.single and not saved.single:
        raise MlxkvError(f"it holds {saved.describe()}'s KV heads (saved under {saved.ranks} ranks); continue it "
                         f"under mlx.launch with {saved.ranks} ranks")
    if saved.ranks != current.ranks:
        raise MlxkvError(f"it was saved under {saved.ranks} ranks, this run has {current.ranks}")
    if saved.rank != current.rank:
        raise MlxkvError(f"it holds rank {saved.rank}'s KV heads, this is rank {current.rank} (give rank 0's "
                         f"file; the other ranks' files are found beside it)")
    if None not in (saved.kv_heads, current.kv_heads) and saved.kv_heads != current.kv_heads:
        raise MlxkvError(f"it holds {saved.kv_heads} KV heads per rank, this rank's model shard has "
                         f"{current.kv_heads} (a different tensor-parallel split)")


def set_key(header: dict, prefix_ids: list[int]) -> str:
    """What every rank file of one saved set shares: model, tokens and per-layer KV settings."""
    shared = [header["model"], prefix_ids, header["layers"], header.get("sharding", {}).get("ranks", 1)]
    return hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()
