"""The Scheduler: the only code that admits, moves and drops rows, by batch size and KV budget.

```
add() -> waiting --admit()--> admitting (one row, prefilled alone) --joined()--> running --drop()--> done
```
A row is admitted only if the batch's caches, with it at its final size, fit the budget as the
byte model counts them (allocation and the join transient, not only stored tokens).
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from ..errors import MlxkvError
from ..units import format_bytes
from .sequence import Sequence, Status


def final_tokens(seq: Sequence) -> int:
    return len(seq.request.prompt_ids) + seq.request.max_tokens


class Scheduler:
    def __init__(self, batch_size: int, kv_budget: int | None = None,
                 batch_need: Callable[[list[int]], int] | None = None):
        if batch_size < 1:
            raise MlxkvError(f"--batch-size must be >= 1, got {batch_size}")
        self.batch_size, self.kv_budget = batch_size, kv_budget
        self.batch_need = batch_need or (lambda lengths: 0)
        self.waiting: deque[Sequence] = deque()
        self.admitting: Sequence | None = None
        self.running: list[Sequence] = []
        self.reserved = 0  # bytes the admitted rows' caches may take at their final sizes

    # -- queue ------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if self.kv_budget is not None:
            need = self.batch_need([final_tokens(seq)])
            if need > self.kv_budget:
                raise MlxkvError(
                    f"row {seq.id} can never fit: its KV needs {format_bytes(need)} at its final size, "
                    f"the budget (--max-kv-bytes) is {format_bytes(self.kv_budget)}")
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.admitting or self.running)

    def _admitted(self) -> list[Sequence]:
        return self.running + ([self.admitting] if self.admitting is not None else [])

    def _need_with(self, seq: Sequence | None) -> int:
        rows = self._admitted() + ([seq] if seq is not None else [])
        return self.batch_need([final_tokens(s) for s in rows])

    def fits(self, seq: Sequence) -> bool:
        return self.kv_budget is None or self._need_with(seq) <= self.kv_budget

    def can_admit(self) -> bool:
        return (self.admitting is None and bool(self.waiting) and len(self.running) < self.batch_size
                and self.fits(self.waiting[0]))

    # -- moves ------------------------------------------------------------------
    def admit(self) -> Sequence | None:
        """The next waiting row, if a slot is free and it fits; it is prefilled before joining."""
        if not self.can_admit():
            return None
        seq = self.waiting.popleft()
        seq.status = Status.PREFILLING
        self.admitting = seq
        self.reserved = self._need_with(None)
        seq.reserved = self.reserved
        return seq

    def joined(self, seq: Sequence) -> None:
        """Its prompt is in: it joins the running rows (or is done already, on its first token)."""
        self.admitting = None
        if not seq.finished:
            self.running.append(seq)
        self.reserved = self._need_with(None)

    def drop(self) -> list[int] | None:
        """Remove finished rows; returns the running indices kept (None: nothing changed)."""
        keep = [i for i, s in enumerate(self.running) if not s.finished]
        if len(keep) == len(self.running):
            return None
        self.running = [self.running[i] for i in keep]
        self.reserved = self._need_with(None)
        return keep

    def abort(self, request_id: str) -> Sequence | None:
        """Finish a row wherever it is ("abort"); running rows leave at the next drop."""
        for s in list(self.waiting):
            if s.id == request_id:
                self.waiting.remove(s)
                s.finish("abort")
                return s
        for s in self._admitted():
            if s.id == request_id:
                s.finish("abort")
                return s
        return None

    def check_progress(self) -> None:
        if self.admitting is None and not self.running and self.waiting and not self.fits(self.waiting[0]):
            raise MlxkvError(f"row {self.waiting[0].id} cannot be admitted within the KV budget")
