"""Run the server: the engine thread, the app, uvicorn; SIGINT/SIGTERM shut it down gracefully
(stop admitting, let running requests finish up to the shutdown timeout, abort the rest, exit 0).

`start_server(config)` runs it on a background thread instead (tests, embedding) and returns a
handle with its URL and `stop()`.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time

from ..errors import MlxkvError
from .config import ServeConfig
from .served import Served, load_served
from .worker import EngineWorker

EXTRA_MODULES = ("fastapi", "uvicorn", "sse_starlette")


def require_extra() -> None:
    """The serve extra's packages, or a one-line error naming it."""
    import importlib

    for name in EXTRA_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            raise MlxkvError(f"mlxkv serve needs the serve extra ({name} is not installed): "
                             f"pip install 'mlxkv[serve]'") from None


def _uvicorn_server(app, config: ServeConfig, log_level: str = "info"):
    import uvicorn
    from sse_starlette.sse import AppStatus

    # streams run to their end on shutdown (uvicorn cancels what is left after the timeout);
    # sse-starlette would otherwise cut them at the signal
    AppStatus.disable_automatic_graceful_drain()

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            app.state.serve.draining = True  # new requests get 503 while running ones finish
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            """uvicorn's, minus re-raising the signal afterwards: a graceful stop exits 0."""
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            old = {s: signal.signal(s, self.handle_exit) for s in sigs}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

    uv = uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level, access_log=False,
                        timeout_graceful_shutdown=config.shutdown_timeout, lifespan="off", server_header=False)
    return Server(uv)


def _bind(config: ServeConfig) -> socket.socket:
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((config.host, config.port))
    except OSError as e:
        sock.close()
        raise MlxkvError(f"cannot listen on {config.host}:{config.port}: {e.strerror or e}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def prepare(config: ServeConfig) -> tuple[EngineWorker, Served, object, socket.socket]:
    """Check the extra, bind the port (a busy port fails before the model loads), load the model
    on the engine thread, and build the app."""
    require_extra()
    from .app import create_app

    sock = _bind(config)
    worker = EngineWorker(lambda: load_served(config))
    try:
        served = worker.start()
    except BaseException:
        sock.close()
        raise
    return worker, served, create_app(worker, served), sock


def serve(config: ServeConfig, on_ready=None, log_level: str = "warning") -> None:
    """Serve until SIGINT/SIGTERM (blocking, on the main thread)."""
    worker, served, app, sock = prepare(config)
    server = _uvicorn_server(app, config, log_level=log_level)
    if on_ready:
        on_ready(served, sock.getsockname()[1])
    try:
        server.run(sockets=[sock])
    finally:
        worker.stop(timeout=10)
        sock.close()


class ServerHandle:
    """A server on a background thread: `url`, `served`, `worker`, `stop()`."""

    def __init__(self, config: ServeConfig, log_level: str = "warning"):
        self.worker, self.served, self.app, self.sock = prepare(config)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{config.host}:{self.port}"
        self.server = _uvicorn_server(self.app, config, log_level=log_level)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="mlxkv-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.server.started:
            self.stop()
            raise MlxkvError("the server did not start")

    def stop(self) -> None:
        self.app.state.serve.draining = True
        self.server.should_exit = True
        self.thread.join(30)
        self.worker.stop(timeout=10)
        self.sock.close()


def start_server(config: ServeConfig, log_level: str = "warning") -> ServerHandle:
    return ServerHandle(config, log_level)
