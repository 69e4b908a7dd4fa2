"""One request in flight, seen from the event loop: submitted to the engine thread, its items
(TokenEvents, then the Completion) read from an asyncio queue; answered whole or as SSE chunks.
Leaving early (a client that disconnects, a cancelled task) aborts the row."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Callable

from ..engine import Completion, Request, TokenEvent
from . import protocol as P
from .errors import APIError
from .worker import ACCEPTED, EngineWorker, Finished


class Generation:
    def __init__(self, worker: EngineWorker, request: Request, on_close: Callable[[], None]):
        self.worker, self.request, self.on_close = worker, request, on_close
        self.queue: asyncio.Queue = asyncio.Queue()
        self.completion: Completion | None = None
        self.cached_tokens = 0  # prompt tokens reused from the prefix cache
        self.closed = False
        loop = asyncio.get_running_loop()

        def push(item):  # on the engine thread
            try:
                loop.call_soon_threadsafe(self.queue.put_nowait, item)
            except RuntimeError:  # the loop is gone (shutdown)
                pass

        worker.submit(request, push)

    async def accepted(self) -> None:
        item = await self.queue.get()
        if isinstance(item, APIError):
            self.close()
            raise item
        if item != ACCEPTED:
            raise RuntimeError(f"the engine thread answered {item!r} before accepting the request")

    async def items(self) -> AsyncIterator[TokenEvent | Completion]:
        while self.completion is None:
            item = await self.queue.get()
            if isinstance(item, APIError):
                raise item
            if isinstance(item, Finished):
                self.completion, self.cached_tokens = item.completion, item.cached_tokens
                item = item.completion
            yield item

    async def result(self) -> Completion:
        async for _ in self.items():
            pass
        return self.completion

    def close(self) -> None:
        """Always called once the request is answered (or abandoned): a row still going is aborted."""
        if self.closed:
            return
        self.closed = True
        if self.completion is None:
            self.worker.abort(self.request.id)
        self.on_close()


def usage_of(gen: Generation) -> dict:
    c = gen.completion
    return P.usage(c.prompt_tokens, len(c.token_ids), gen.cached_tokens)


async def until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def answer(gen: Generation, receive) -> Completion | None:
    """The whole completion, or None if the client went away first (the row is aborted)."""
    work = asyncio.ensure_future(gen.result())
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


async def chat_events(gen: Generation, rid: str, model: str, include_usage: bool) -> AsyncIterator[dict]:
    created = P.now()
    try:
        yield _data(P.chat_chunk(rid, model, created, {"role": "assistant", "content": ""}))
        async for item in gen.items():
            if isinstance(item, Completion):
                yield _data(P.chat_chunk(rid, model, created, {}, item.finish_reason))
                if include_usage:
                    yield _data(P.chat_chunk(rid, model, created, {}, use=usage_of(gen)))
            elif item.text:
                yield _data(P.chat_chunk(rid, model, created, {"content": item.text}))
        yield {"data": "[DONE]"}
    except APIError as e:
        yield _data(e.to_json())
    finally:
        gen.close()


async def completion_events(gen: Generation, rid: str, model: str, include_usage: bool) -> AsyncIterator[dict]:
    created = P.now()
    try:
        async for item in gen.items():
            if isinstance(item, Completion):
                yield _data(P.completion_chunk(rid, model, created, "", item.finish_reason))
                if include_usage:
                    yield _data(P.completion_chunk(rid, model, created, "", use=usage_of(gen)))
            elif item.text:
                yield _data(P.completion_chunk(rid, model, created, item.text))
        yield {"data": "[DONE]"}
    except APIError as e:
        yield _data(e.to_json())
    finally:
        gen.close()
