"""The plain decode step: one token for every running row, pipelined as mlx-lm's generate_step.

A decode step is an object the Engine is composed with (the speculative round is another,
kvcore/speculative/engine.py), with hooks for rows joining and leaving. Per step: one forward, one
`async_eval` that queues the NEXT step on the lazily sampled tokens, then one read-back of
this step's tokens: the host never waits for the device inside a step otherwise. With a
constrained row the next step's mask needs this step's token, so only the next forward is queued
(just after the read-back) and its sampling is built at the next step, while that forward runs:
the masks are computed on the host as the device works, still one async_eval and one read-back.
"""

from __future__ import annotations

import time

import mlx.core as mx

from .sampling import token_column
from .sequence import TokenEvent


class PlainDecode:
    merge_single = False  # a lone row decodes on its own caches

    def __init__(self):
        self.queued: mx.array | None = None  # the next step's tokens (B,), computing while we read these
        self.logits: mx.array | None = None  # or, with a constrained row, its logits (B, V): masked next step

    def reset(self) -> None:
        self.queued = self.logits = None

    # -- membership hooks ---------------------------------------------------------
    def before_change(self, engine) -> list[TokenEvent]:
        """Before the batch changes shape: settle the queued step (its tokens are real)."""
        if self.logits is not None:
            self.queued, self.logits = engine.runner.sample(self.logits, engine.scheduler.running), None
        if self.queued is None:
            return []
        out, self.queued = self.queued, None
        return self._consume(engine, out, time.perf_counter())

    def joined(self, engine, seq) -> None:
        pass

    def filtered(self, engine, keep: list[int]) -> None:
        if self.queued is not None:
            self.queued = self.queued[mx.array(keep)] if keep else None
        if self.logits is not None:
            self.logits = self.logits[mx.array(keep)] if keep else None

    # -- the step -------------------------------------------------------------------
    def step(self, engine) -> list[TokenEvent]:
        t0 = time.perf_counter()
        rows = engine.scheduler.running
        out = self.queued
        if out is None:  # constrained rows' masks are computed here, while the queued forward runs
            logits = self.logits if self.logits is not None else engine.runner.forward(
                mx.array([[s.next_token] for s in rows]))[:, -1, :]
            out = engine.runner.sample(logits, rows)
        self.queued = self.logits = None
        more = any(s.remaining > 1 for s in rows)
        if more and all(s.constraint is None for s in rows):
            self.queued = engine.runner.sample(engine.runner.forward(token_column(out))[:, -1, :], rows)
            mx.async_eval(self.queued)
        elif more:  # a constrained row's next mask needs this step's token: queue only the forward,
            self.logits = engine.runner.forward(token_column(out))[:, -1, :]  # after the read-back
        return self._consume(engine, out, t0, self.logits)

    def _consume(self, engine, out: mx.array, t0: float, then: mx.array | None = None) -> list[TokenEvent]:
        toks = out.tolist()  # the step's one read-back
        if then is not None:
            mx.async_eval(then)  # the next forward, queued once this step's tokens are read
        rows = engine.scheduler.running
        engine.decode_time += time.perf_counter() - t0
        engine.decoded += len(toks)
        engine.trace.append(("decode", tuple(s.id for s in rows)))
        return [s.take(t) for s, t in zip(rows, toks) if not s.finished]
