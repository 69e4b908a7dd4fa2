"""Speculative decoding over continuous batching: BatchEngine's admission, prefill, stops
and budget, with a speculative round in place of its decode step.

One round, every running row at once:
  1. caps: at most k drafts, fewer near max_tokens or before a conversion start;
  2. the provider drafts up to cap tokens per row (0 allowed);
  3. ONE target pass verifies [pending, drafts...] per row, right-padded to the longest;
  4. each row keeps its accepted prefix plus one target token (accept.py);
  5. each row's target and draft caches roll back by its own rejected count (rows.py);
  6. the tokens are emitted; a row may finish on any of them.

Conversion at the start: a row's verified tokens never reach its quantization start unless
the row's pending token already stands at it (cap = start - 1 - position). A conversion
therefore only ever happens before a pass whose every stored token is final, at exactly the
position plain decoding converts, and a rollback never has to undo one.
"""

from __future__ import annotations

import time
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn

from ..engine.batch import BatchEngine
from ..engine.generate import Completion, GenerateConfig, Request
from ..engine.stats import kv_summary
from ..errors import MlxkvError
from ..policy import KVPolicy
from .accept import Verdict, accept_greedy, accept_sampled, sampling_probs
from .drafts import DraftProvider
from .rows import Checkpoint, check_caches, feed, next_starts, pad, rollback
from .stats import SpecStats


class SpecEngine(BatchEngine):
    def __init__(self, model: nn.Module, tokenizer, policy: KVPolicy, draft: DraftProvider,
                 num_draft: int = 4, batch_size: int = 8, config: GenerateConfig = GenerateConfig(), **kwargs):
        if num_draft < 1:
            raise MlxkvError(f"--num-draft-tokens must be >= 1, got {num_draft}")
        # mlxkv caches on every layer, so rollback is row-local; no spare window slots: the
        # target only ever rolls back within its last update
        super().__init__(model, tokenizer, replace(policy, rollback=0), batch_size, config, **kwargs)
        self.draft, self.k = draft, num_draft
        self.stats = SpecStats(num_draft)

    def run(self, requests: list[Request]) -> list[Completion]:
        self.draft.reset(self.k)
        self.stats = SpecStats(self.k)
        return super().run(requests)

    # -- rows join and leave the draft provider with the batch ------------------
    def _join(self, row) -> None:
        super()._join(row)
        if self.running and self.running[-1] is row:
            check_caches(self.caches)
            self.draft.add_row(list(row.request.prompt_ids) + row.out.token_ids)

    def _drop_finished(self) -> None:
        keep = [i for i, r in enumerate(self.running) if not r.out.finish_reason]
        if len(keep) != len(self.running):
            self.draft.filter(keep)
        super()._drop_finished()

    # -- a round ------------------------------------------------------------------
    def _caps(self, contexts: list[list[int]]) -> list[int]:
        caps = []
        for row, ctx, s in zip(self.running, contexts, next_starts(self.caches)):
            pos = len(ctx) - 1  # the pending token's position
            k = min(self.k, row.request.max_tokens - len(row.out.token_ids) - 1)
            if s is not None and s > pos:
                k = min(k, s - 1 - pos)  # verified positions stay before the start
            caps.append(max(k, 0))
        return caps

    def _verify(self, logits: mx.array, drafts: list[list[int]], probs) -> Verdict:
        sampling = self.config.sampling
        if sampling.temp == 0:
            return accept_greedy(logits, drafts)
        return accept_sampled(sampling_probs(sampling, logits), drafts, probs)

    def _decode_step(self, pipeline: bool = True) -> None:
        """One speculative round for every running row."""
        t0 = time.perf_counter()
        rows = list(self.running)
        contexts = [list(r.request.prompt_ids) + r.out.token_ids for r in rows]
        caps = self._caps(contexts)
        proposal = self.draft.propose(contexts, caps)
        drafts = [list(t[:k]) for t, k in zip(proposal.tokens, caps)]
        fed = [[ctx[-1]] + d for ctx, d in zip(contexts, drafts)]
        ckpt = Checkpoint.take(self.caches)
        tokens, lengths = pad(fed)
        logits = feed(self.model, self.caches, tokens, lengths)  # (B, K, V)
        verdict = self._verify(logits, drafts, proposal.probs)
        self.stats.replays += rollback(self.model, self.caches, fed, [a + 1 for a in verdict.accepted], ckpt)
        self.draft.accept(verdict.accepted)
        self.stats.record([len(d) for d in drafts], verdict.accepted, tokens.shape[1])
        self.decode_time += time.perf_counter() - t0
        self.trace.append(("decode", tuple(r.request.id for r in rows)))
        for row, toks in zip(rows, verdict.tokens):
            for t in toks:
                self.decoded += 1
                self._emit(row, t)
                if row.out.finish_reason:
                    break
        kv = kv_summary(self.caches)
        if kv["kv_bytes"] >= self.peak_kv.get("kv_bytes", 0):
            self.peak_kv = kv
