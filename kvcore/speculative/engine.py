"""Speculative decoding as the Engine's decode step: the Engine's admission, prefill, stops
and budget, with a speculative round in place of the plain step.

One round, every running row at once:
  1. caps: at most k drafts, fewer near max_tokens or before a conversion start;
  2. the provider drafts up to cap tokens per row (0 allowed);
  3. ONE target pass verifies [pending, drafts...] per row, right-padded to the longest;
  4. each row keeps its accepted prefix plus one target token (accept.py);
  5. each row's target and draft caches roll back by its own rejected count (rows.py);
  6. the tokens are handed to the rows; a row may finish on any of them.

Conversion at the start: a row's verified tokens never reach its quantization start unless
the row's pending token already stands at it (cap = start - 1 - position). A conversion
therefore only ever happens before a pass whose every stored token is final, at exactly the
position plain decoding converts, and a rollback never has to undo one.
"""

from __future__ import annotations

import time
from dataclasses import replace

import mlx.nn as nn

from ..engine.constrain import apply_masks, verify_masks
from ..engine.engine import Engine, GenerateConfig
from ..engine.sequence import TokenEvent
from ..errors import MlxkvError
from ..policy import KVPolicy
from .accept import Verdict, accept_greedy, accept_sampled, row_logprobs, sampling_probs
from .drafts import DraftProvider
from .rows import Checkpoint, check_caches, feed, next_starts, pad, rollback
from .stats import SpecStats


class SpeculativeDecode:
    merge_single = True  # rollback is row-local on batch caches, from the first row on

    def __init__(self, draft: DraftProvider, num_draft: int = 4):
        if num_draft < 1:
            raise MlxkvError(f"--num-draft-tokens must be >= 1, got {num_draft}")
        self.draft, self.k = draft, num_draft
        self.stats = SpecStats(num_draft)

    def policy(self, policy: KVPolicy) -> KVPolicy:
        # mlxkv caches on every layer, so rollback is row-local; no spare window slots: the
        # target only ever rolls back within its last update
        return replace(policy, rollback=0)

    def reset(self) -> None:
        self.draft.reset(self.k)
        self.stats = SpecStats(self.k)

    # -- rows join and leave the draft provider with the batch ------------------
    def before_change(self, engine) -> list[TokenEvent]:
        return []

    def joined(self, engine, seq) -> None:
        if seq.sampling.adjusted:
            raise MlxkvError("logit bias and repetition, presence or frequency penalties are not supported with "
                             "speculative decoding")
        check_caches(engine.caches)
        self.draft.add_row(seq.context)

    def filtered(self, engine, keep: list[int]) -> None:
        self.draft.filter(keep)

    # -- a round ------------------------------------------------------------------
    def _caps(self, rows, contexts: list[list[int]], caches) -> list[int]:
        caps = []
        for row, ctx, s in zip(rows, contexts, next_starts(caches)):
            pos = len(ctx) - 1  # the pending token's position
            k = min(self.k, row.remaining - 1)
            if s is not None and s > pos:
                k = min(k, s - 1 - pos)  # verified positions stay before the start
            caps.append(max(k, 0))
        return caps

    def _verify(self, engine, logits, drafts, probs) -> Verdict:
        sampling = engine.config.sampling
        if sampling.temp == 0:
            return accept_greedy(logits, drafts)
        return accept_sampled(sampling_probs(sampling, logits), drafts, probs)

    def step(self, engine) -> list[TokenEvent]:
        """One speculative round for every running row."""
        t0 = time.perf_counter()
        rows = list(engine.running)
        caches = engine.caches
        contexts = [r.context for r in rows]
        caps = self._caps(rows, contexts, caches)
        proposal = self.draft.propose(contexts, caps)
        drafts = [list(t[:k]) for t, k in zip(proposal.tokens, caps)]
        fed = [[ctx[-1]] + d for ctx, d in zip(contexts, drafts)]
        ckpt = Checkpoint.take(caches)
        tokens, lengths = pad(fed)
        logits = feed(engine.model, caches, tokens, lengths)  # (B, K, V)
        raw = logits
        if any(r.constraint is not None for r in rows):  # each position masked after the drafts before it
            logits = apply_masks(logits, verify_masks(rows, drafts, logits.shape[1]))
        verdict = self._verify(engine, logits, drafts, proposal.probs)
        lps = row_logprobs(raw, verdict.tokens, [r.sampling.logprobs for r in rows])  # the target's
        self.stats.replays += rollback(engine.model, caches, fed, [a + 1 for a in verdict.accepted], ckpt)
        self.draft.accept(verdict.accepted)
        self.stats.record([len(d) for d in drafts], verdict.accepted, tokens.shape[1])
        engine.decode_time += time.perf_counter() - t0
        engine.trace.append(("decode", tuple(r.id for r in rows)))
        events = []
        for row, toks, lp in zip(rows, verdict.tokens, lps):
            for j, t in enumerate(toks):
                engine.decoded += 1
                events.append(row.append(t, lp[j] if lp else None))
                if row.finished:
                    break
        return events


def SpecEngine(model: nn.Module, tokenizer, policy: KVPolicy, draft: DraftProvider, num_draft: int = 4,
               batch_size: int = 8, config: GenerateConfig = GenerateConfig(), **kwargs) -> Engine:
    """The Engine composed with a speculative round (kept under its earlier name)."""
    return Engine(model, tokenizer, policy, batch_size, config, decoder=SpeculativeDecode(draft, num_draft),
                  **kwargs)
