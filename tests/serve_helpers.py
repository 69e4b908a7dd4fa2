"""Helpers for the serve tests: raw HTTP (stdlib, so any body can be sent) and /metrics parsing."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request


def post(url: str, body, key: str | None = None, path: str = "/v1/chat/completions", timeout: float = 30):
    """(status, parsed JSON or text) of a POST; `body` is sent as is if bytes, else as JSON."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="POST", headers={"Content-Type": "application/json"})
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    return _send(req, timeout)


def get(url: str, path: str, key: str | None = None, timeout: float = 30):
    req = urllib.request.Request(url + path)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    return _send(req, timeout)


def _send(req, timeout):
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, _parse(r.read())
    except urllib.error.HTTPError as e:
        return e.code, _parse(e.read())


def _parse(raw: bytes):
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode()


def metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^mlxkv_{name}{re.escape(labels)} (\S+)$", text, re.M)
    assert m, f"mlxkv_{name}{labels} not in /metrics"
    return float(m.group(1))


def wait_for(cond, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def served_port(stderr, lines: int = 5) -> int:
    """The port a `mlxkv serve` process announces on stderr (one-line notes, e.g. about BLAS, may come first)."""
    seen = []
    for _ in range(lines):
        line = stderr.readline()
        seen.append(line)
        m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        if m:
            return int(m.group(1))
    raise AssertionError(f"no serving line in the first {lines} stderr lines: {seen}")
