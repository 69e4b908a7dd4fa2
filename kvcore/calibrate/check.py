"""End-to-end checks: a config's teacher-forced KL through its real caches, as `mlxkv fidelity` measures it."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from ..fidelity import TokenStats, pool, teacher_forced_logprobs, token_stats
from ..fidelity.bytes import KVBytes, kv_bytes
from ..policy import KVPolicy, build_caches


@dataclass
class Window:
    """Tokens and the full-precision reference log-probabilities (T, vocab) they are measured against."""

    name: str
    tokens: list[int]
    reference: mx.array


@dataclass
class Measured:
    stats: list[TokenStats] = field(default_factory=list)
    kv: list[KVBytes] = field(default_factory=list)

    @property
    def mean_kl(self) -> float:
        return pool(self.stats).mean_kl

    @property
    def bits_per_element(self) -> float:
        """At the end of each window (deployed bytes: dense data and metadata at 2 bytes), averaged."""
        return sum(k.bits_per_element for k in self.kv) / len(self.kv)

    def to_json(self) -> dict:
        f = pool(self.stats)
        return {"mean_kl": f.mean_kl, "p99_kl": f.p99_kl, "top1_agreement": f.top1_agreement, "ppl": f.ppl,
                "ppl_reference": f.ppl_reference, "bits_per_element": self.bits_per_element,
                "kv_bytes": self.kv[-1].deployed, "positions": sum(len(s.kl) for s in self.stats)}


def reference(model: nn.Module, name: str, tokens: list[int], chunk: int) -> Window:
    """A held-out window's reference: the model with full-precision KV, teacher-forced as the checks are."""
    lp = teacher_forced_logprobs(model, tokens, build_caches(model, KVPolicy())[0], chunk)
    return Window(name, tokens, lp)


def measure(model: nn.Module, windows: list[Window], policy: KVPolicy, chunk: int) -> Measured:
    out = Measured()
    for w in windows:
        caches = build_caches(model, policy)[0]
        lp = teacher_forced_logprobs(model, w.tokens, caches, chunk)
        out.stats.append(token_stats(w.reference, lp, w.tokens))
        out.kv.append(kv_bytes(caches))
        del caches, lp
        mx.clear_cache()
    return out
