"""A draft model: a (smaller) model with the target's tokenizer drafts k tokens per row.

Its caches (its own KV policy, rollback-capable) hold each row's context except the tokens
it has not seen yet, the row's `lag`: the pending token, plus the last draft when every
draft was kept. A round feeds the lag, then one draft at a time for all rows at once; a row
past its cap feeds padding (trimmed). Drafts never make the draft's caches convert: a row's
cap stops its speculative tokens before its conversion start.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

from ..engine.forward import prefill
from ..engine.sampling import SamplingConfig
from ..errors import MlxkvError
from ..policy import KVOptions, KVPolicy, build_caches, plan_layers, resolve_policy
from .accept import sampling_probs
from .drafts import DraftProvider, Proposal, register_draft
from .rows import Checkpoint, check_caches, feed, feed_lists, next_starts, rollback

if TYPE_CHECKING:
    from ..models import LoadedModel
    from ..jobs.generate import GenerateJob
    from .drafts import SpecOptions


def check_same_tokenizer(target, draft, source: str) -> None:
    """One-line error unless both tokenizers map the same strings to the same ids."""
    a, b = target.get_vocab(), draft.get_vocab()
    if a != b:
        differ = sum(1 for t, i in a.items() if b.get(t) != i) + sum(1 for t in b if t not in a)
        raise MlxkvError(f"draft model {source} has a different tokenizer than the target ({len(b)} vs "
                         f"{len(a)} tokens, {differ} differ); speculative decoding needs the same vocabulary")


def draft_policy(kv: KVOptions, bits: int | None) -> KVPolicy:
    """The target's KV options, or `bits` instead (0: full precision; a kv_config is dropped)."""
    if bits is None:
        return resolve_policy(kv)
    return resolve_policy(replace(kv, kv_bits=bits or None, kv_config=None,
                                  profile=None if bits == 0 else kv.profile))


@register_draft("model")
class ModelDraft(DraftProvider):
    def __init__(self, model: nn.Module, policy: KVPolicy = KVPolicy(),
                 sampling: SamplingConfig = SamplingConfig(), prefill_chunk: int = 512, source: str = "draft"):
        self.model, self.policy, self.sampling = model, policy, sampling
        self.chunk, self.source = prefill_chunk, source
        self.models = (model,)
        self.caches: list | None = None  # per-layer batch caches, rows in the engine's order
        self.seen: list[int] = []  # tokens each row's caches hold
        self._round = None  # (fed, caps, lag lengths, checkpoint) of the round being verified

    @classmethod
    def from_job(cls, opts: "SpecOptions", job: "GenerateJob", target: "LoadedModel") -> "ModelDraft":
        from ..models import load_model

        if not opts.draft_model:
            raise MlxkvError("--draft model needs --draft-model PATH")
        lm = load_model(opts.draft_model, job.dtype)
        check_same_tokenizer(target.tokenizer, lm.tokenizer, lm.source)
        policy = draft_policy(job.kv, opts.draft_kv_bits)
        try:
            plan_layers(lm.model, policy)
        except MlxkvError as e:
            raise MlxkvError(f"draft model {lm.source}: {e}")
        return cls(lm.model, policy, job.sampling, job.prefill_chunk, lm.source)

    def describe(self) -> dict:
        return {"draft": self.name, "draft_model": self.source, "draft_kv_codec": self.policy.codec.label(),
                "draft_kv_start": self.policy.start, "draft_max_kv_size": self.policy.max_kv_size}

    # -- rows -----------------------------------------------------------------
    def reset(self, max_draft: int) -> None:
        super().reset(max_draft)
        self.caches, self.seen, self._round = None, [], None

    def add_row(self, context: list[int]) -> None:
        # rollback: the lag (<= 2) and the drafts fed in one round, over single-token updates
        caches, _ = build_caches(self.model, replace(self.policy, rollback=self.max_draft + 2))
        prefill(self.model, context[:-1], caches, self.chunk)
        mx.eval([c.state for c in caches])
        merged = [type(c).merge([c]) for c in caches]
        check_caches(merged)
        if self.caches is None:
            self.caches = merged
        else:
            for mine, new in zip(self.caches, merged):
                mine.extend(new)
        self.seen.append(len(context) - 1)

    def filter(self, keep: list[int]) -> None:
        self.seen = [self.seen[i] for i in keep]
        if not keep:
            self.caches = None
            return
        idx = mx.array(keep)
        for c in self.caches:
            c.filter(idx)

    # -- a round ----------------------------------------------------------------
    def _draw(self, logits: mx.array) -> tuple[mx.array, mx.array | None]:
        """(B, V) logits -> next draft tokens (B,) and their distributions (None if greedy)."""
        if self.sampling.temp == 0:
            return mx.argmax(logits, axis=-1), None
        p = sampling_probs(self.sampling, logits)
        return mx.random.categorical(mx.log(p), axis=-1), p

    def propose(self, contexts: list[list[int]], caps: list[int]) -> Proposal:
        B = len(contexts)
        pos = [len(c) - 1 for c in contexts]  # the pending token's position
        # speculative tokens sit at pos+1 .. pos+cap-1 in the draft: all before its start
        caps = [min(k, s - p) if s is not None and s > p else k
                for k, s, p in zip(caps, next_starts(self.caches), pos)]
        self._round = None
        if max(caps, default=0) == 0:
            return Proposal([[] for _ in range(B)])
        lag = [c[n:] for c, n in zip(contexts, self.seen)]
        ckpt = Checkpoint.take(self.caches)
        y, p = self._draw(feed_lists(self.model, self.caches, lag))
        ys, ps = [y], [p]
        for j in range(1, max(caps)):
            logits = feed(self.model, self.caches, y[:, None], [int(k > j) for k in caps])
            y, p = self._draw(logits[:, -1])
            ys.append(y)
            ps.append(p)
        drafted = mx.stack(ys, axis=1).tolist()
        tokens = [d[:k] for d, k in zip(drafted, caps)]
        fed = [g + t[: max(k - 1, 0)] for g, t, k in zip(lag, tokens, caps)]
        self._round = (fed, caps, [len(g) for g in lag], ckpt)
        return Proposal(tokens, None if ps[0] is None else mx.stack(ps, axis=1))

    def accept(self, accepted: list[int]) -> None:
        if self._round is None:
            return
        fed, caps, lags, ckpt = self._round
        keep = [g + (min(a, k - 1) if k else 0) for a, k, g in zip(accepted, caps, lags)]
        rollback(self.model, self.caches, fed, keep, ckpt)
        self.seen = [n + k for n, k in zip(self.seen, keep)]
        self._round = None
