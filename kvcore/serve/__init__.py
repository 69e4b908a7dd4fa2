"""`mlxkv serve`: an OpenAI-compatible HTTP server on the continuous-batching engine.

The engine runs on one thread (worker.py) fed through a command queue; the HTTP side
(FastAPI + uvicorn + sse-starlette, the `serve` extra) validates requests (protocol.py,
requests.py), turns them into engine Requests and streams their TokenEvents back
(generation.py). server.py runs it; metrics.py renders /metrics.
"""

from .config import ServeConfig
from .server import ServerHandle, require_extra, serve, start_server

__all__ = ["ServeConfig", "ServerHandle", "require_extra", "serve", "start_server"]
