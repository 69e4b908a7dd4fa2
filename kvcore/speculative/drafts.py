"""Draft providers: one interface, a registry by name ("model", "prompt-lookup", ...).

The engine keeps the rows in order and tells the provider everything that changes them:

```
reset(max_draft)          a new run: at most max_draft tokens a round
add_row(context)          a row joined (context: prompt + first token)
propose(contexts, caps)   a round: at most caps[b] tokens for row b (0 allowed)
accept(accepted)          after verification: drafts kept per row
filter(keep)              rows that stay, in order
```
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import mlx.core as mx

from ..errors import MlxkvError

if TYPE_CHECKING:
    from ..models import LoadedModel
    from ..jobs.generate import GenerateJob

MAX_DRAFT = 64


@dataclass(frozen=True)
class SpecOptions:
    """What the user asked for (flags); validated before anything loads."""

    draft: str = "model"  # a registered provider
    draft_model: str | None = None  # with "model": a folder, .gguf or cached repo id
    num_draft_tokens: int = 4
    draft_kv_bits: int | None = None  # None: the target's KV policy; 0: full precision
    max_ngram: int = 3  # prompt lookup: longest suffix matched

    def __post_init__(self):
        if not 1 <= self.num_draft_tokens <= MAX_DRAFT:
            raise MlxkvError(f"--num-draft-tokens must be in 1..{MAX_DRAFT}, got {self.num_draft_tokens}")
        if self.draft not in _REGISTRY:
            raise MlxkvError(f"unknown draft {self.draft!r} (choose from {', '.join(draft_names())})")
        if self.draft_kv_bits is not None and self.draft_kv_bits < 0:
            raise MlxkvError(f"--draft-kv-bits must be >= 0, got {self.draft_kv_bits}")


@dataclass
class Proposal:
    tokens: list[list[int]]  # per row, 0 .. caps[b] draft tokens
    probs: mx.array | None = None  # (B, max drafted, V) draft distributions; None: point masses
    # (a draft id the target's logits lack is simply rejected)


class DraftProvider:
    name = "base"
    models: tuple = ()  # draft models that need an attention context while the run lasts

    def reset(self, max_draft: int) -> None:
        self.max_draft = max_draft

    def add_row(self, context: list[int]) -> None:
        pass

    def propose(self, contexts: list[list[int]], caps: list[int]) -> Proposal:
        raise NotImplementedError

    def accept(self, accepted: list[int]) -> None:
        pass

    def filter(self, keep: list[int]) -> None:
        pass

    def describe(self) -> dict:
        return {"draft": self.name}

    @classmethod
    def from_job(cls, opts: SpecOptions, job: "GenerateJob", target: "LoadedModel") -> "DraftProvider":
        """Build it for a `generate` job (loads what it needs, checks it fits the target)."""
        return cls()


_REGISTRY: dict[str, Callable[..., DraftProvider]] = {}


def register_draft(name: str):
    """Class decorator: `make_draft(name, **kwargs)` builds it."""
    def deco(cls):
        _REGISTRY[name] = cls
        cls.name = name
        return cls

    return deco


def draft_names() -> list[str]:
    return sorted(_REGISTRY)


def make_draft(name: str, **kwargs) -> DraftProvider:
    if name not in _REGISTRY:
        raise MlxkvError(f"unknown draft {name!r} (choose from {', '.join(draft_names())})")
    return _REGISTRY[name](**kwargs)


def draft_for_job(opts: SpecOptions, job: "GenerateJob", target: "LoadedModel") -> DraftProvider:
    return _REGISTRY[opts.draft].from_job(opts, job, target)
