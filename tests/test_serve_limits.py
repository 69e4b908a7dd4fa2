"""`mlxkv serve` at its limits: a full queue (429), a client that disconnects (its row is aborted),
a row the KV budget can never hold, the command line (SIGTERM exits 0) and the missing extra.

The engine thread is held between steps with `worker.call` (a busy engine), so what the server
does while requests wait is deterministic."""

from __future__ import annotations

import http.client
import importlib.util
import json
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from typer.testing import CliRunner

from serve_helpers import get, metric, post, served_port, wait_for
from kvcore.serve import ServeConfig, start_server
from kvcore.serve.server import EXTRA_MODULES
from mlxkv_cli.main import build_app

BUDGET = 600_000  # the embedded model: one row of <= 256 tokens (320 KiB) fits, a longer one never does


def needs_serve_extra() -> None:
    """Skip where the serve extra is absent (the device image): only its own one-line error runs there."""
    for name in EXTRA_MODULES:
        pytest.importorskip(name)


@pytest.fixture(scope="module")
def server():
    needs_serve_extra()
    h = start_server(ServeConfig(port=0, batch_size=2, max_queue=0, max_kv_bytes=BUDGET))
    yield h
    h.stop()


def hold(server, started: bool = True) -> threading.Event:
    """Hold the engine thread between steps until the returned event is set."""
    release, running = threading.Event(), threading.Event()

    def held(_engine):
        running.set()
        release.wait(30)

    server.worker.call(held)
    if started:
        assert running.wait(10)
    return release


def body(server, **kw):
    return {"model": server.served.name, "messages": [{"role": "user", "content": "Once upon a time"}],
            "max_tokens": 4, "temperature": 0, **kw}


def metrics(server) -> str:
    status, text = get(server.url, "/metrics")
    assert status == 200
    return text


def test_a_full_queue_is_429_and_the_waiting_requests_still_complete(server):
    state = server.app.state.serve
    release = hold(server)
    with ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(post, server.url, body(server)) for _ in range(2)]
        wait_for(lambda: state.in_flight == 2)  # batch 2 + queue 0: full
        status, err = post(server.url, body(server))
        assert status == 429 and err["error"]["code"] == "queue_full"
        release.set()
        assert [f.result()[0] for f in waiting] == [200, 200]
    assert post(server.url, body(server, n=3))[0] == 429  # three rows can never be in flight here
    assert post(server.url, body(server))[0] == 200
    assert metric(metrics(server), "http_refused_total", '{status="429"}') == 2


def test_a_client_that_disconnects_frees_its_row(server):
    state = server.app.state.serve
    before = metric(metrics(server), "generated_tokens_total")
    first = hold(server)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps(body(server, max_tokens=200, stream=True)),
                 {"Content-Type": "application/json"})
    wait_for(lambda: state.in_flight == 1)  # its add is queued behind the held engine
    second = hold(server, started=False)  # runs right after the add: the row waits, accepted
    first.set()
    resp = conn.getresponse()
    assert resp.status == 200
    while not resp.readline().startswith(b"data:"):  # the role chunk
        pass
    conn.close()
    wait_for(lambda: state.in_flight == 0)  # the server saw the disconnect and aborted the row
    second.set()
    wait_for(lambda: 'reason="abort"} 1' in metrics(server))
    text = metrics(server)
    assert metric(text, "generated_tokens_total") - before <= 3  # not the 200 it asked for
    assert metric(text, "running_rows") == 0 and metric(text, "waiting_rows") == 0
    assert post(server.url, body(server))[0] == 200


def test_a_client_that_leaves_before_a_whole_answer_frees_its_row(server):
    state = server.app.state.serve
    aborted = lambda: metric(metrics(server), "requests_finished_total", '{reason="abort"}')  # noqa: E731
    before = aborted()
    first = hold(server)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"model": server.served.name, "prompt": "Tom", "max_tokens": 200}),
                 {"Content-Type": "application/json"})
    wait_for(lambda: state.in_flight == 1)
    second = hold(server, started=False)
    first.set()
    conn.close()  # gone before the answer (not streamed) is ready
    wait_for(lambda: state.in_flight == 0)
    second.set()
    wait_for(lambda: aborted() == before + 1)
    assert post(server.url, body(server))[0] == 200


def test_a_row_the_kv_budget_never_holds_is_refused(server):
    status, err = post(server.url, body(server, max_tokens=300))
    assert status == 400 and err["error"]["code"] == "context_length_exceeded"
    assert "KV budget" in err["error"]["message"] and "--max-kv-bytes" in err["error"]["message"]
    ok, r = post(server.url, body(server, max_tokens=100))
    assert ok == 200 and r["usage"]["completion_tokens"] <= 100
    assert metric(metrics(server), "kv_budget_bytes") == BUDGET


def test_serve_command_finishes_a_running_stream_on_sigterm_and_exits_0(tiny_models):
    needs_serve_extra()
    proc = subprocess.Popen([sys.executable, "-m", "mlxkv_cli", "serve", "-m", str(tiny_models("qwen3")),
                             "--port", "0", "--api-key", "k"], stderr=subprocess.PIPE, text=True)
    try:
        port = served_port(proc.stderr)
        url = f"http://127.0.0.1:{port}"
        assert get(url, "/health")[0] == 200 and get(url, "/v1/models")[0] == 401
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({
            "model": "qwen3", "prompt": "Once upon a time", "max_tokens": 300, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}), {"Content-Type": "application/json", "Authorization": "Bearer k"})
        resp = conn.getresponse()
        assert resp.status == 200
        while not resp.readline().startswith(b"data:"):
            pass
        proc.send_signal(signal.SIGTERM)  # mid-stream: it runs to its end, then the server exits
        data = [ln[5:].strip() for ln in resp.read().decode().splitlines() if ln.startswith("data:")]
        assert data[-1] == "[DONE]" and json.loads(data[-2])["usage"]["completion_tokens"] == 300
        assert proc.wait(60) == 0
        assert proc.stderr.read().strip().splitlines()[-1] == "server stopped"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_without_the_serve_extra_it_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # what `import fastapi` meets without the extra
    r = CliRunner().invoke(build_app(), ["serve"])
    assert r.exit_code == 1
    assert r.output.strip() == ("error: mlxkv serve needs the serve extra (fastapi is not installed): "
                                "pip install 'mlxkv[serve]'")


@pytest.mark.parametrize("args,message", [
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--port", "70000"], "--port must be in 0..65535"),
    (["--max-body-bytes", "lots"], "--max-body-bytes: cannot read 'lots'"),
    (["--kv-bits", "7"], "7"),
])
def test_bad_serve_flags_are_one_line(args, message):
    if not all(importlib.util.find_spec(name) for name in EXTRA_MODULES):
        message = "needs the serve extra"  # checked first: without it, that is the one line
    r = CliRunner().invoke(build_app(), ["serve", *args])
    assert r.exit_code == 1 and message in r.output and len(r.output.strip().splitlines()) == 1


def test_a_failing_step_fails_its_requests_and_a_fresh_engine_serves_on(server):
    def break_next_step(engine):
        def boom():
            raise RuntimeError("boom")
        engine._decode_step = boom  # fault injection: the next decode step raises

    release = hold(server)
    with ThreadPoolExecutor(1) as pool:
        failing = pool.submit(post, server.url, body(server))
        wait_for(lambda: server.app.state.serve.in_flight == 1)
        server.worker.call(break_next_step)
        release.set()
        status, err = failing.result()
    assert status == 500 and err["error"]["message"] == "internal error: RuntimeError: boom"
    ok, r = post(server.url, body(server))
    assert ok == 200 and r["usage"]["completion_tokens"] == 4
    assert get(server.url, "/health") == (200, {"status": "ok"})


def test_a_request_counted_in_flight_is_already_submitted():
    """The limit tests hold the engine and then wait for `in_flight`: a request must be in the engine's queue by
    the time it is counted (else a hold queued in between runs before its add, and its disconnect goes unseen)."""
    needs_serve_extra()
    from kvcore.serve.app import ServeState
    from kvcore.serve.errors import APIError

    state, seen = ServeState(max_pending=2), []
    assert state.enter(2, lambda: seen.append(state.in_flight) or "gen") == "gen"
    assert seen == [0] and state.in_flight == 2
    with pytest.raises(APIError) as e:
        state.enter(1, lambda: seen.append("submitted"))
    assert e.value.status == 429 and seen == [0] and state.in_flight == 2
    state.leave(2)
    assert state.in_flight == 0
