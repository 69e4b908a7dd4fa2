"""A tiny Hugging Face hub on loopback: serves one folder as a model repo (what huggingface_hub
asks for: the model's file list, then a HEAD and a GET per file). Point HF_ENDPOINT at `url`."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, repo: str, folder: Path):
        self.repo, self.folder = repo, Path(folder)
        self.files = {p.name: p.read_bytes() for p in sorted(self.folder.iterdir()) if p.is_file()}
        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self._serve(body=False)

            def do_GET(self):
                self._serve(body=True)

            def _serve(self, body: bool):
                hub.requests.append(f"{self.command} {self.path}")
                path = self.path.split("?", 1)[0]
                if path in (f"/api/models/{hub.repo}", f"/api/models/{hub.repo}/revision/main"):
                    siblings = [{"rfilename": n, "size": len(b), "blobId": hashlib.sha1(b).hexdigest()}
                                for n, b in hub.files.items()]
                    return self._send(json.dumps({"id": hub.repo, "modelId": hub.repo, "sha": COMMIT,
                                                  "siblings": siblings}).encode(), "application/json", body)
                for rev in ("main", COMMIT):
                    prefix = f"/{hub.repo}/resolve/{rev}/"
                    if path.startswith(prefix) and path[len(prefix):] in hub.files:
                        data = hub.files[path[len(prefix):]]
                        return self._send(data, "application/octet-stream", body,
                                          {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha1(data).hexdigest()}"'})
                self._send(json.dumps({"error": "Repository not found"}).encode(), "application/json", body,
                           {"X-Error-Code": "RepoNotFound"}, status=404)

            def _send(self, data: bytes, kind: str, body: bool, headers: dict | None = None, status: int = 200):
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                if body:
                    self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
