"""One request in flight, seen from the event loop: its rows (one per choice, `n`) submitted to
the engine thread, their items (TokenEvents, then a Finished) read from one asyncio queue; the
request is answered whole or as SSE chunks. Leaving early (a client that disconnects, a
cancelled task) aborts every row still going."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import deque
from typing import AsyncIterator, Callable

from ..engine import Completion, Request, TokenEvent
from . import protocol as P
from .errors import APIError
from .worker import ACCEPTED, EngineWorker, Finished


class Mailbox:
    """Items from the engine thread to the event loop's queues, handed over in one wake-up of the
    loop per batch (one decode step's tokens for every stream), not one per token."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: deque[tuple[asyncio.Queue, object]] = deque()
        self.lock = threading.Lock()
        self.scheduled = False

    def put(self, queue: asyncio.Queue, item) -> None:  # on the engine thread
        with self.lock:
            self.items.append((queue, item))
            if self.scheduled:
                return
            self.scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is gone (shutdown)
            pass

    def _deliver(self) -> None:  # on the event loop
        with self.lock:
            items, self.items, self.scheduled = self.items, deque(), False
        for queue, item in items:
            queue.put_nowait(item)


class Generation:
    def __init__(self, worker: EngineWorker, requests: list[Request], on_close: Callable[[], None], box: Mailbox,
                 body=None):
        self.worker, self.requests, self.on_close, self.body = worker, requests, on_close, body
        self.queue: asyncio.Queue = asyncio.Queue()  # (choice index, item)
        self.completions: list[Completion | None] = [None] * len(requests)
        self.cached = [0] * len(requests)  # prompt tokens each row reused from the prefix cache
        self.early: list[tuple[int, object]] = []  # items that came before every row was accepted
        self.closed = False
        for i, request in enumerate(requests):
            worker.submit(request, lambda item, i=i: box.put(self.queue, (i, item)))

    @property
    def done(self) -> bool:
        return all(c is not None for c in self.completions)

    async def accepted(self) -> None:
        """Every row is in the engine's queue, or the first refusal is raised (the others aborted)."""
        waiting, error = set(range(len(self.requests))), None
        while waiting:
            i, item = await self.queue.get()
            if item == ACCEPTED or isinstance(item, APIError):
                waiting.discard(i)
                error = error or (item if isinstance(item, APIError) else None)
            else:
                self.early.append((i, item))
        if error is not None:
            self.close()
            raise error

    async def items(self) -> AsyncIterator[tuple[int, TokenEvent | Completion]]:
        while not self.done:
            i, item = self.early.pop(0) if self.early else await self.queue.get()
            if isinstance(item, APIError):
                raise item
            if isinstance(item, Finished):
                self.completions[i], self.cached[i] = item.completion, item.cached_tokens
                item = item.completion
            yield i, item

    async def results(self) -> list[Completion]:
        async for _ in self.items():
            pass
        return self.completions

    def usage(self) -> dict:
        """The prompt once (as OpenAI counts n choices), every choice's tokens, the best reuse."""
        cs = [c for c in self.completions if c is not None]
        prompt = len(self.requests[0].prompt_ids)
        return P.usage(prompt, sum(len(c.token_ids) for c in cs), min(prompt, max(self.cached, default=0)))

    def close(self) -> None:
        """Always called once the request is answered (or abandoned): rows still going are aborted."""
        if self.closed:
            return
        self.closed = True
        for request, c in zip(self.requests, self.completions):
            if c is None:
                self.worker.abort(request.id)
        self.on_close()


async def until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def answer(gen: Generation, receive) -> list[Completion] | None:
    """Every choice's completion, or None if the client went away first (the rows are aborted)."""
    work = asyncio.ensure_future(gen.results())
    gone = asyncio.ensure_future(until_disconnect(receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            gen.close()
    return work.result() if work.done() and not work.cancelled() else None


def _data(obj) -> dict:
    return {"data": json.dumps(obj, separators=(",", ":"))}


async def events(gen: Generation, rid: str, model: str, include_usage: bool, endpoint) -> AsyncIterator[dict]:
    """The request's SSE items: each choice's deltas as the endpoint's stream makes them
    (endpoints.py), the usage chunk if asked, then [DONE]."""
    created = P.now()
    stream = endpoint.stream(gen.body, len(gen.requests))

    def items(deltas: list[dict]):
        return [_data(P.chunk(endpoint.chunk_obj, rid, model, created, d)) for d in deltas]

    try:
        for i in range(len(gen.requests)):
            for item in items(stream.start(i)):
                yield item
        async for i, item in gen.items():
            deltas = stream.end(i, item.finish_reason) if isinstance(item, Completion) else \
                stream.text(i, item.text) if item.text else []
            for out in items(deltas):
                yield out
        if include_usage:
            yield _data(P.chunk(endpoint.chunk_obj, rid, model, created, use=gen.usage()))
        yield {"data": "[DONE]"}
    except APIError as e:
        yield _data(e.to_json())
    finally:
        gen.close()
