"""The engine thread: one Engine, stepped while requests are pending, fed through a command queue.

```
HTTP handlers --submit/abort/call--> commands --> [engine thread] add_request / abort / step
      ^                                                    |
      +--- push(item) per request: "accepted" | TokenEvent... | Finished (or an APIError)
```
Every MLX call happens on this thread (the model is loaded here too). A request's `push` is
called from this thread and must hand the item over thread-safely (the app uses the event
loop's call_soon_threadsafe). The thread blocks on the queue when there is no work.
"""

from __future__ import annotations

import gc
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from ..engine import Completion, Request
from ..errors import MlxkvError, first_line
from ..units import format_bytes
from .errors import APIError
from .metrics import EngineMetrics
from .requests import refused
from .served import Served

Push = Callable[[object], None]
ACCEPTED = "accepted"


@dataclass(frozen=True)
class Finished:
    """A request's last item: its Completion, and how many prompt tokens came from the prefix cache."""

    completion: Completion
    cached_tokens: int = 0


class EngineWorker:
    def __init__(self, load: Callable[[], Served]):
        self._load = load
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Push] = {}
        self._thread = threading.Thread(target=self._main, name="mlxkv-engine", daemon=True)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.served: Served | None = None
        self.engine = None
        self.metrics = EngineMetrics()

    # -- called from other threads --------------------------------------------------
    def start(self) -> Served:
        """Load the model on the engine thread; its errors are raised here."""
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self.served

    def submit(self, request: Request, push: Push) -> None:
        self._commands.put(("add", request, push))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id, None))

    def call(self, fn: Callable) -> Future:
        """Run fn(engine) on the engine thread between steps; its result as a Future."""
        fut: Future = Future()
        self._commands.put(("call", fn, fut))
        return fut

    def stop(self, timeout: float | None = None) -> None:
        """Abort every row still in flight and end the thread."""
        if self._thread.is_alive():
            self._commands.put(("stop", None, None))
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self.engine = None
        # MLX objects of the ended thread left in reference cycles until the interpreter exits
        # abort it there (std::terminate): collect them now
        gc.collect()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- the engine thread ------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.served = self._load()
            self.engine = self.served.new_engine()
        except BaseException as e:  # noqa: BLE001 (handed to start())
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001: a bug outside a step; nothing may hang on it
            self._error = e
            self._fail_all(APIError(503, f"the engine stopped: {type(e).__name__}: {e}", code="engine_stopped"))
            self._drain_after_death()

    def _loop(self) -> None:
        handlers = {"add": self._add, "abort": self._abort, "call": self._call}
        while True:
            block = not self.engine.has_work
            try:
                commands = [self._commands.get(block=block)]
            except queue.Empty:
                commands = []
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            if any(c[0] == "stop" for c in commands):
                for c in commands:
                    if c[0] == "call":
                        c[2].cancel()
                self._shutdown()
                return
            for kind, a, b in commands:
                handlers[kind](a, b)
            if self.engine.has_work:
                self._step()
            self._sweep()

    def _fail_all(self, err: APIError) -> None:
        for push in self._sinks.values():
            push(err)
        self._sinks.clear()

    def _drain_after_death(self) -> None:
        """Answer what is still queued (a submit racing the crash) instead of leaving it waiting."""
        while True:
            try:
                kind, a, b = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                b(APIError(503, "the engine stopped", code="engine_stopped"))
            elif kind == "call":
                b.cancel()

    def _add(self, request: Request, push: Push) -> None:
        sch = self.engine.scheduler
        need = sch.batch_need([len(request.prompt_ids) + request.max_tokens])
        if sch.kv_budget is not None and need > sch.kv_budget:
            push(APIError(400, f"prompt + max_tokens ({len(request.prompt_ids) + request.max_tokens} tokens) can "
                               f"never fit the KV budget: they need {format_bytes(need)} of KV, the budget "
                               f"(--max-kv-bytes) is {format_bytes(sch.kv_budget)}", code="context_length_exceeded"))
            return
        try:
            self.engine.add_request(request)
        except MlxkvError as e:  # e.g. a constraint its compiler refuses
            push(refused(request, e))
            return
        self._sinks[request.id] = push
        self.metrics.added(len(request.prompt_ids))
        push(ACCEPTED)

    def _abort(self, request_id: str, _) -> None:
        self.engine.abort(request_id)

    def _call(self, fn: Callable, fut: Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(self.engine))
        except BaseException as e:  # noqa: BLE001 (handed to the caller)
            fut.set_exception(e)

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception as e:  # noqa: BLE001: every row in flight fails; a fresh engine serves on
            self._fail_all(APIError(500, f"internal error: {type(e).__name__}: {first_line(e, None, empty='')}"))
            self.engine = self.served.new_engine()
            return
        self.metrics.stepped(self.engine, events)
        for ev in events:
            push = self._sinks.get(ev.id)
            if push is not None:
                push(ev)

    def _sweep(self) -> None:
        """Finished rows (also those that ended without an event: aborted, max_tokens 0) hand
        their Completion over and leave; the engine keeps none of them."""
        done = self.engine.done
        prefix = self.engine.prefix
        for rid, completion in done.items():
            push = self._sinks.pop(rid, None)
            self.metrics.finished(completion)
            cached = prefix.reused.pop(rid, 0) if prefix is not None else 0
            if push is not None:
                push(Finished(completion, cached))
        done.clear()
        del self.engine.trace[:]  # the server reads its figures per step (metrics), never the history

    def _shutdown(self) -> None:
        for rid in list(self._sinks):
            self.engine.abort(rid)
        self._sweep()
        self._fail_all(APIError(503, "the server is shutting down", code="shutting_down"))
        if self.engine.prefix is not None:
            self.engine.prefix.flush()  # what RAM holds into the disk tier, for the next server
