"""The plain decode step: one token for every running row, pipelined as mlx-lm's generate_step.

A decode step is an object the Engine is composed with (the speculative round is another,
kvcore/speculative/engine.py), with hooks for rows joining and leaving. Per step: one forward, one
`async_eval` that queues the NEXT step on the lazily sampled tokens, then one read-back of
this step's tokens: the host never waits for the device inside a step otherwise.
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

    def reset(self) -> None:
        self.queued = None

    # -- membership hooks ---------------------------------------------------------
    def before_change(self, engine) -> list[TokenEvent]:
        """Before the batch changes shape: settle the queued step (its tokens are real)."""
        if self.queued is None:
            return []
        out, self.queued = self.queued, None
        return self._consume(engine, out, time.perf_counter())

    def joined(self, engine, seq) -> None:
        pass

    def filtered(self, engine, keep: list[int]) -> None:
        if self.queued is not None:
            self.queued = self.queued[mx.array(keep)] if keep else None

    # -- the step -------------------------------------------------------------------
    def step(self, engine) -> list[TokenEvent]:
        t0 = time.perf_counter()
        rows = engine.scheduler.running
        out = self.queued
        if out is None:
            out = self._next(engine, mx.array([[s.next_token] for s in rows]), rows)
        # a constrained row's next mask needs this step's token: no step is queued ahead then
        more = any(s.remaining > 1 for s in rows) and all(s.constraint is None for s in rows)
        self.queued = self._next(engine, token_column(out), rows) if more else None
        if self.queued is not None:
            mx.async_eval(self.queued)
        return self._consume(engine, out, t0)

    def _next(self, engine, y: mx.array, rows) -> mx.array:
        """y (B, 1) -> sampled next tokens (B,), lazily."""
        return engine.runner.sample(engine.runner.forward(y)[:, -1, :], rows)

    def _consume(self, engine, out: mx.array, t0: float) -> list[TokenEvent]:
        toks = out.tolist()  # the step's one read-back
        rows = engine.scheduler.running
        engine.decode_time += time.perf_counter() - t0
        engine.decoded += len(toks)
        engine.trace.append(("decode", tuple(s.id for s in rows)))
        return [s.take(t) for s, t in zip(rows, toks) if not s.finished]
