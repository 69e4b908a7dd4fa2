"""The HTTP API (FastAPI): OpenAI's chat and text completions, models, health and metrics.

Every route but /health needs the API key when one is set; bodies are read up to a size limit
and validated strictly; errors are OpenAI's JSON shape. Nothing from a request reaches the
filesystem: the served model is fixed at start.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException

from .. import __version__
from . import protocol as P
from .errors import APIError, from_validation
from .endpoints import CHAT, TEXT, Endpoint
from .generation import Generation, Mailbox, answer, events
from .metrics import render, snapshot
from .openapi import install as install_openapi
from .requests import check_model, engine_requests
from .served import Served
from .worker import EngineWorker

T = TypeVar("T")

OPEN_PATHS = ("/health",)
METRICS_WAIT_S = 30.0  # /metrics waits at most this long for the engine thread (one step)
DRAIN_BYTES = 64 * 2**20  # an oversized body up to this size is read (and dropped) before the 413


class ServeState:
    """What the routes share: in-flight count (the queue limit), draining flag, refusals."""

    def __init__(self, max_pending: int):
        self.max_pending = max_pending
        self.in_flight = 0
        self.draining = False
        self.refused: Counter = Counter()
        self.started = int(time.time())
        self._box: Mailbox | None = None

    def mailbox(self) -> Mailbox:
        """The running loop's mailbox (made on first use, inside the loop)."""
        loop = asyncio.get_running_loop()
        if self._box is None or self._box.loop is not loop:
            self._box = Mailbox(loop)
        return self._box

    def enter(self, rows: int, submit: Callable[[], T]) -> T:
        """Admit `rows` rows: refused (503, 429), or submitted and then counted in flight, so a request
        counted in flight is already in the engine's queue (nothing awaits in between)."""
        if self.draining:
            self.refused[503] += 1
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self.in_flight + rows > self.max_pending:
            self.refused[429] += 1
            raise APIError(429, f"the server is at capacity ({self.max_pending} rows in flight); retry later",
                           code="queue_full", type="rate_limit_exceeded")
        out = submit()
        self.in_flight += rows
        return out

    def leave(self, rows: int) -> None:
        self.in_flight -= rows


class APIKeyMiddleware:
    """`Authorization: Bearer KEY` on every route but /health (pure ASGI: streams pass untouched)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        auth = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return await self.app(scope, receive, send)
        err = APIError(401, "Incorrect API key provided" if auth else "Missing API key: send Authorization: Bearer KEY",
                       code="invalid_api_key")
        await JSONResponse(err.to_json(), 401)(scope, receive, send)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 past `limit` bytes (by Content-Length, or while it streams)."""
    declared = request.headers.get("content-length", "")
    too_big = APIError(413, f"the request body is larger than the limit of {limit} bytes", code="request_too_large")
    if declared.isdigit() and int(declared) > max(limit, DRAIN_BYTES):
        raise too_big  # answered at once (the client may see the connection close)
    body, seen = bytearray(), 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen <= limit:
            body += chunk
        elif seen > max(limit, DRAIN_BYTES):
            break
    if seen > limit:  # the rest was read and dropped, so the client reads the 413 before the close
        raise too_big
    return bytes(body)


def create_app(worker: EngineWorker, served: Served) -> FastAPI:
    config = served.config
    state = ServeState(config.max_pending)
    app = FastAPI(title="mlxkv", version=__version__, docs_url=None, redoc_url=None)
    app.state.serve = state
    install_openapi(app, served.models)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, key=config.api_key)
    if config.cors:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return JSONResponse(e.to_json(), e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        msg = f"Unknown path {request.url.path}" if e.status_code == 404 else str(e.detail)
        return JSONResponse(APIError(e.status_code, msg, code=str(e.status_code)).to_json(), e.status_code)

    async def parse(request: Request, model):
        raw = await read_body(request, config.max_body_bytes)
        try:
            body = model.model_validate_json(raw or b"null")
        except ValidationError as e:
            raise from_validation(e.errors(include_url=False)) from None
        check_model(body, served)
        return body

    async def start(body, ids: list[int], rid: str) -> Generation:
        rows = engine_requests(body, rid, ids, served)
        if not worker.alive:
            raise APIError(503, "the engine has stopped", code="engine_stopped")
        n = len(rows)
        gen = state.enter(n, lambda: Generation(worker, rows, lambda: state.leave(n), state.mailbox(), body))
        try:
            await gen.accepted()
        except BaseException:
            gen.close()
            raise
        return gen

    async def complete(request: Request, ep: Endpoint):
        body = await parse(request, ep.body)
        rid = P.new_id(ep.id_prefix)
        gen = await start(body, ep.prompt(served, body), rid)
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            return EventSourceResponse(events(gen, rid, body.model, include, ep), ping=15)
        try:
            cs = await answer(gen, request.receive)
        finally:
            gen.close()
        if cs is None:
            return Response(status_code=499)
        return P.response(ep.obj, rid, body.model, [ep.choice(served, body, i, c) for i, c in enumerate(cs)],
                          gen.usage())

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await complete(request, CHAT)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, TEXT)

    def model_card(name: str) -> dict:
        card = {"id": name, "object": "model", "created": state.started, "owned_by": "mlxkv"}
        return card if name == served.name else {**card, "parent": served.name}  # an adapter (vLLM's field)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(m) for m in served.models]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id not in served.models:
            raise APIError(404, f"The model '{model_id}' does not exist", "model", "model_not_found")
        return model_card(model_id)

    @app.get("/health")
    async def health():
        ok = worker.alive and not state.draining
        return JSONResponse({"status": "ok" if ok else "unavailable"}, 200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        if not worker.alive:
            raise APIError(503, "the engine has stopped", code="engine_stopped")
        try:
            gauges = await asyncio.wait_for(asyncio.wrap_future(worker.call(snapshot)), METRICS_WAIT_S)
        except asyncio.TimeoutError:
            raise APIError(503, f"the engine thread did not answer within {METRICS_WAIT_S:g} s", code="busy") from None
        return PlainTextResponse(render(worker.metrics, gauges, state.refused, state.in_flight),
                                 media_type="text/plain; version=0.0.4")

    return app
