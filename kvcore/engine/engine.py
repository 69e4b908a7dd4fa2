"""The Engine: a Scheduler, a Runner and a decode step, driven one `step()` at a time.

```python
engine.add_request(req)          # queue a row (its own sampling settings and seed, if any)
events = engine.step()           # admit / prefill one chunk / decode one token for every row
engine.abort(req.id)             # the row ends ("abort") and leaves at the next step
```
One step: (1) admit the next waiting row if a slot is free and its KV fits the budget;
(2) run ONE prefill chunk of the row being admitted (alone, so no padding is stored); when its
prompt is done, sample its first token and join it to the running rows; (3) one decode step
(plain or speculative) for every running row; finished rows leave. Running rows therefore
never wait more than one prefill chunk between two decode steps. `run(requests)` is a loop
over `step()`; `generate`, `chat` and `serve` drive the same API.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from ..attention.config import DEFAULT as DEFAULT_ATTENTION
from ..attention.config import AttentionConfig
from ..errors import MlxkvError
from ..policy import KVPolicy
from ..transient import PrefillMemory
from .decode import PlainDecode
from .forward import DEFAULT_PREFILL_CHUNK
from .runner import Runner
from .sampling import SamplingConfig
from .scheduler import Scheduler, final_tokens
from .sequence import Completion, Request, Sequence, TokenEvent
from .stats import kv_summary


@dataclass(frozen=True)
class GenerateConfig:
    sampling: SamplingConfig = SamplingConfig()
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    prefill_memory: PrefillMemory | None = field(default=None, compare=False)  # bounds long prompts' prefill


class Engine:
    def __init__(self, model: nn.Module, tokenizer, policy: KVPolicy, batch_size: int = 8,
                 config: GenerateConfig = GenerateConfig(), kv_budget: int | None = None,
                 batch_need: Callable[[list[int]], int] | None = None,
                 on_finish: Callable[[Completion], None] | None = None, interleave: bool = True,
                 decoder=None, attention: AttentionConfig = DEFAULT_ATTENTION, ignore_eos: bool = False):
        self.model, self.tokenizer, self.policy, self.config = model, tokenizer, policy, config
        self.decoder = decoder or PlainDecode()
        self.scheduler = Scheduler(batch_size, kv_budget, batch_need)
        self.runner = Runner(model, self.decoder_policy(policy), config.prefill_chunk, config.sampling,
                             attention, self.decoder.merge_single, config.prefill_memory)
        self.on_finish = on_finish
        self.ignore_eos = ignore_eos  # benchmarks: every row runs to its max_tokens
        self.eos: set | None = None  # end tokens for every row (None: the tokenizer's)
        self.interleave = interleave  # False: admit (prefill) every row that fits before decoding
        self.trace: list[tuple] = []  # ("prefill", id, tokens) | ("decode", ids)
        self.done: dict[str, Completion] = {}
        self.decode_time = 0.0  # wall seconds inside decode steps
        self.decoded = 0  # tokens produced by decode steps
        self.peak_kv: dict = {}  # kv_summary of the running caches when they held the most
        self._prefix = None

    @property
    def prefix(self):
        """An optional prefix store (serve/prefix.py): .restore(seq) on admission, .store(seq, pages) once its
        prompt is in; with one, rows that page keep their prompts in the pools' pages (Runner.keep_pages)."""
        return self._prefix

    @prefix.setter
    def prefix(self, store) -> None:
        self._prefix = store
        self.runner.keep_pages = store is not None

    def decoder_policy(self, policy: KVPolicy) -> KVPolicy:
        adapt = getattr(self.decoder, "policy", None)
        return adapt(policy) if adapt else policy

    # -- the open API ---------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.scheduler.batch_size

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def caches(self) -> list | None:
        return self.runner.caches

    @property
    def stats(self):
        """The decode step's statistics (speculative rounds), if it keeps any."""
        return getattr(self.decoder, "stats", None)

    @property
    def attention_stats(self):
        return self.runner.stats

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add_request(self, request: Request) -> Sequence:
        seq = Sequence(request, self.tokenizer, self.config.sampling)
        if self.ignore_eos or self.eos is not None:
            seq.eos = set() if self.ignore_eos else set(self.eos)
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        seq = self.scheduler.abort(request_id)
        if seq is not None and seq.status.value == "finished" and seq not in self.scheduler.running:
            self._finished(seq)
        return seq is not None

    def step(self) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        sch = self.scheduler
        if sch.admitting is None and sch.waiting and len(sch.running) < sch.batch_size:
            seq = sch.admit()
            if seq is not None:
                seq.caches = self.runner.new_caches()
                if self.prefix is not None:
                    self.prefix.restore(seq)  # may start it from cached prompt tokens (seq.done_prompt)
        seq = sch.admitting
        if seq is not None and seq.finished:  # aborted while prefilling
            sch.joined(seq)
            seq.caches = None
        elif seq is not None:
            events += self._prefill(seq)
        if sch.running and (self.interleave or sch.admitting is None and not sch.can_admit()):
            events += self._decode_step() or []
        events += self._drop_finished()
        sch.check_progress()
        return events

    def run(self, requests: list[Request]) -> list[Completion]:
        """These requests' completions, in order (a run's own: ids may repeat across runs, not in one)."""
        seen: set[str] = set()
        for r in requests:
            if r.id in seen:
                raise MlxkvError(f"request id {r.id!r} appears twice in one run: each row needs its own id")
            seen.add(r.id)
        self.reset()
        self.done.clear()  # a reused id must get this run's completion, not an earlier run's
        for r in requests:
            self.add_request(r)
        while self.has_work:
            self.step()
        return [self.done[r.id] for r in requests]

    def reset(self) -> None:
        reset = getattr(self.decoder, "reset", None)
        if reset:
            reset()

    # -- internals ------------------------------------------------------------------
    def _prefill(self, seq: Sequence) -> list[TokenEvent]:
        before = seq.done_prompt
        logits = self.runner.prefill_step(seq)
        self.trace.append(("prefill", seq.id, seq.done_prompt - before))
        if logits is None:
            return []
        tok = self.runner.sample(logits, [seq])
        mx.eval(tok)
        paged = self.prefix is not None and self.runner.pages_row(seq.caches)
        seq.started()
        events = []
        if not seq.finished:
            events.append(seq.take(tok.tolist()[0]))
        if self.prefix is not None and not (paged and not seq.finished):
            self.prefix.store(seq)  # a copy of its caches, which hold exactly its prompt here
        if seq.finished:
            self.scheduler.joined(seq)
            self._finished(seq)
            seq.caches = None
            return events
        events += self.decoder.before_change(self)
        events += self._drop_finished()
        if self.prefix is not None and not paged and self.runner.pooled:
            self.prefix.unpool()  # this row cannot page: the batch leaves the pools, entries become copies
        self.runner.join(seq.caches, list(seq.request.prompt_ids))
        if paged:  # its prompt's pages in the pools, pinned by the entry (no copy)
            self.prefix.store(seq, self.runner.row_pages(len(self.runner.ids) - 1))
        seq.caches = None
        self.scheduler.joined(seq)
        self.runner.reserve([final_tokens(s) for s in self.scheduler.running])
        self.runner.mark_rows([len(s.context) for s in self.scheduler.running])
        self.decoder.joined(self, seq)
        return events

    def _decode_step(self) -> list[TokenEvent]:
        self.runner.select_rows(self.scheduler.running)  # per-row adapters, if any (a prefill chose its row's)
        return self.decoder.step(self)

    def _drop_finished(self) -> list[TokenEvent]:
        if not any(s.finished for s in self.scheduler.running):
            return []
        self._note_peak()
        for s in self.scheduler.running:
            if s.finished:
                self._finished(s)
        keep = self.scheduler.drop()
        self.decoder.filtered(self, keep)
        self.runner.filter(keep)
        if not keep and self.prefix is not None:  # idle pools give back what no entry pins
            moved = self.runner.compact(self.prefix.compact_free)
            if moved:
                self.prefix.renumber(moved)
        self.runner.mark_rows([len(s.context) for s in self.scheduler.running])
        return []

    def _finished(self, seq: Sequence) -> None:
        if self.done.get(seq.id) is seq.out:  # reported already (aborted, then dropped)
            return
        self.done[seq.id] = seq.out
        if self.on_finish:
            self.on_finish(seq.out)

    def _note_peak(self) -> None:
        """KV only grows between leaves: its peak is read just before rows leave."""
        if self.runner.caches is None:
            return
        kv = kv_summary(self.runner.caches)
        if kv["kv_bytes"] >= self.peak_kv.get("kv_bytes", 0):
            self.peak_kv = kv
