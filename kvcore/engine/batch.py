"""Continuous batching: rows join and leave a shared decode step.

Scheduler loop (one iteration):
  1. admit the next waiting request if a slot is free and its KV fits the budget;
  2. run ONE prefill chunk of the row being admitted (alone, so no padding is stored);
     when its prompt is done, sample its first token and merge its caches into the batch;
  3. run one decode step for every running row; finished rows leave (filter).
So running rows never wait for more than one prefill chunk between two decode steps.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from ..errors import MlxkvError
from ..policy import KVPolicy, build_caches
from ..units import format_bytes
from .forward import forward, prefill_chunk
from .generate import Completion, GenerateConfig, Request
from .stats import kv_summary
from .stops import StopMatcher


@dataclass
class Row:
    request: Request
    caches: list
    out: Completion
    detok: object
    matcher: StopMatcher
    reserved: int
    done_prompt: int = 0
    next_token: int | None = None
    t_start: float = field(default_factory=time.perf_counter)
    t_decode: float = 0.0


class BatchEngine:
    def __init__(self, model: nn.Module, tokenizer, policy: KVPolicy, batch_size: int = 8,
                 config: GenerateConfig = GenerateConfig(), kv_budget: int | None = None,
                 row_bytes: Callable[[Request], int] = lambda r: 0,
                 on_finish: Callable[[Completion], None] | None = None, interleave: bool = True):
        if batch_size < 1:
            raise MlxkvError(f"--batch-size must be >= 1, got {batch_size}")
        self.model, self.tokenizer, self.policy = model, tokenizer, policy
        self.batch_size, self.config = batch_size, config
        self.kv_budget, self.row_bytes, self.on_finish = kv_budget, row_bytes, on_finish
        self.interleave = interleave  # False: admit (prefill) every row that fits before decoding
        self.eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
        self.sampler = config.sampling.sampler()
        self.trace: list[tuple] = []  # ("prefill", id, tokens) | ("decode", ids)
        self.caches: list | None = None  # per-layer batch caches of the running rows
        self.running: list[Row] = []  # rows whose caches are merged into self.caches, in order
        self.done: dict[str, Completion] = {}
        self.reserved = 0
        self.decode_time = 0.0  # wall seconds inside decode steps
        self.decoded = 0  # tokens produced by decode steps
        self.peak_kv: dict = {}  # kv_summary of the running caches when they held the most
        self.queued: mx.array | None = None  # next step's tokens (B,), computing while we read these

    # -- public ---------------------------------------------------------------
    def run(self, requests: list[Request]) -> list[Completion]:
        self._check_fits(requests)
        waiting, admitting = deque(requests), None
        while waiting or admitting or self.running:
            if admitting is None and waiting and len(self.running) < self.batch_size:
                admitting = self._admit(waiting)
            if admitting is not None and self._prefill_step(admitting):
                self._join(admitting)
                admitting = None
            if self.running and (self.interleave or admitting is None and not self._can_admit(waiting)):
                self._decode_step()
            self._drop_finished()
            if admitting is None and not self.running and waiting and not self._fits(waiting[0]):
                raise MlxkvError(f"row {waiting[0].id} cannot be admitted within the KV budget")
        return [self.done[r.id] for r in requests]

    # -- admission ------------------------------------------------------------
    def _can_admit(self, waiting: deque) -> bool:
        return bool(waiting) and len(self.running) < self.batch_size and self._fits(waiting[0])

    def _fits(self, req: Request) -> bool:
        return self.kv_budget is None or self.reserved + self.row_bytes(req) <= self.kv_budget

    def _check_fits(self, requests: list[Request]) -> None:
        if self.kv_budget is None:
            return
        for r in requests:
            need = self.row_bytes(r)
            if need > self.kv_budget:
                raise MlxkvError(
                    f"row {r.id} can never fit: its KV needs {format_bytes(need)} at its final size, "
                    f"the budget (--max-kv-bytes) is {format_bytes(self.kv_budget)}"
                )

    def _admit(self, waiting: deque) -> Row | None:
        if not self._fits(waiting[0]):
            return None  # waits until a running row leaves
        req = waiting.popleft()
        caches, _ = build_caches(self.model, self.policy)
        detok = self.tokenizer.detokenizer if self.tokenizer is not None else None
        if detok is not None:
            detok.reset()
        row = Row(req, caches, Completion(req.id, prompt_tokens=len(req.prompt_ids)), detok,
                  StopMatcher(req.stop), self.row_bytes(req))
        self.reserved += row.reserved
        return row

    # -- prefill and join -------------------------------------------------------
    def _prefill_step(self, row: Row) -> bool:
        """One chunk of the row's prompt; True once the prompt is done and a token is sampled."""
        ids = list(row.request.prompt_ids)
        before = row.done_prompt
        row.done_prompt, logits = prefill_chunk(self.model, ids, row.caches, before, self.config.prefill_chunk)
        self.trace.append(("prefill", row.request.id, row.done_prompt - before))
        if row.done_prompt < len(ids):
            mx.eval([c.state for c in row.caches])
            return False
        tok = self._sample(logits[:, -1, :])
        mx.eval(tok)
        row.out.prompt_time = time.perf_counter() - row.t_start
        row.t_decode = time.perf_counter()
        if row.request.max_tokens == 0:
            self._finish(row, "length")
        else:
            self._emit(row, int(tok.item()))
        return True

    def _join(self, row: Row) -> None:
        if row.out.finish_reason:
            return  # finished on its first token: never joins
        if self.queued is not None:  # settle the queued step before the batch changes shape
            out, self.queued = self.queued, None
            self._consume(out, time.perf_counter())
            self._drop_finished()
        merged = [type(c).merge([c]) for c in row.caches]
        if self.caches is None:
            self.caches = merged
        else:
            for mine, new in zip(self.caches, merged):
                mine.extend(new)
        row.caches = []
        self.running.append(row)

    # -- decode ---------------------------------------------------------------
    def _decode_step(self, pipeline: bool = True) -> None:
        """One token for every running row. With `pipeline`, the following step is queued on
        the (lazy) sampled tokens before they are read back, as mlx-lm's generate_step does;
        a row that finishes meanwhile only wastes its share of that step."""
        t0 = time.perf_counter()
        out = self.queued
        if out is None:
            out = self._step(mx.array([[r.next_token] for r in self.running]))
        more = any(len(r.out.token_ids) + 1 < r.request.max_tokens for r in self.running)
        self.queued = self._step(out[:, None]) if pipeline and more else None
        if self.queued is not None:
            mx.async_eval(self.queued)
        self._consume(out, t0)

    def _step(self, y: mx.array) -> mx.array:
        """y: (B, 1) -> sampled next tokens (B,), lazily."""
        return self._sample(forward(self.model, y, self.caches)[:, -1, :])

    def _consume(self, out: mx.array, t0: float) -> None:
        toks = out.tolist()
        self.decode_time += time.perf_counter() - t0
        self.decoded += len(toks)
        self.trace.append(("decode", tuple(r.request.id for r in self.running)))
        for row, tok in zip(self.running, toks):
            self._emit(row, tok)
        kv = kv_summary(self.caches)
        if kv["kv_bytes"] >= self.peak_kv.get("kv_bytes", 0):
            self.peak_kv = kv

    def _sample(self, logits: mx.array) -> mx.array:
        return self.sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    def _emit(self, row: Row, tok: int) -> None:
        if tok in self.eos:
            return self._finish(row, "eos")
        row.out.token_ids.append(tok)
        cut = None
        if row.detok is not None:
            row.detok.add_token(tok)
            text = row.detok.text
            cut = row.matcher.find(text)
        if cut is not None:
            row.out.text = text[:cut]
            return self._finish(row, "stop")
        if len(row.out.token_ids) >= row.request.max_tokens:
            return self._finish(row, "length")
        row.next_token = tok

    def _finish(self, row: Row, reason: str) -> None:
        row.out.finish_reason = reason
        row.out.gen_time = time.perf_counter() - row.t_decode if row.t_decode else 0.0
        if reason != "stop" and row.detok is not None:
            row.detok.finalize()
            row.out.text = row.detok.text
        self.done[row.request.id] = row.out
        self.reserved -= row.reserved
        row.reserved = 0
        if self.on_finish:
            self.on_finish(row.out)

    def _drop_finished(self) -> None:
        keep = [i for i, r in enumerate(self.running) if not r.out.finish_reason]
        if len(keep) == len(self.running):
            return
        self.running = [self.running[i] for i in keep]
        if not self.running:
            self.caches = self.queued = None
            return
        idx = mx.array(keep)
        for c in self.caches:
            c.filter(idx)
        if self.queued is not None:
            self.queued = self.queued[idx]
