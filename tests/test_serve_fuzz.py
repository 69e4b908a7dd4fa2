"""The API fuzzed from its own OpenAPI document (schemathesis) against a real server on loopback:
the embedded model, a small batch and queue (so big `n` meets the 429), the prefix cache on.
A bounded, derandomized run (the same cases every time); no response may be a 5xx, and the
server still answers a plain request afterwards."""

from __future__ import annotations

import time

import pytest

from serve_helpers import post
from kvcore.serve import ServeConfig, start_server
from kvcore.serve.server import EXTRA_MODULES

KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {KEY}"}
CASES = 60
WALL_S = 40


@pytest.fixture(scope="module")
def server():
    for name in EXTRA_MODULES:
        pytest.importorskip(name)
    h = start_server(ServeConfig(port=0, batch_size=4, max_queue=4, api_key=KEY, max_tokens=8, prefill_chunk=64,
                                 prefix_cache_bytes=8 * 2**20))
    yield h
    h.stop()


def test_the_openapi_document_describes_the_bodies(server):
    from serve_helpers import get

    status, doc = get(server.url, "/openapi.json", KEY)
    assert status == 200 and doc["info"]["version"]
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    chat = doc["components"]["schemas"][body["$ref"].rsplit("/", 1)[1]]
    assert chat["additionalProperties"] is False and "messages" in chat["required"]
    assert chat["properties"]["model"]["enum"] == [server.served.name]
    assert get(server.url, "/openapi.json")[0] == 401  # behind the key like every route but /health


def test_fuzzed_requests_never_get_a_server_error(server):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from schemathesis.checks import not_a_server_error

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", headers=AUTH)
    cases = st.one_of(schema.as_strategy(schemathesis.GenerationMode.POSITIVE),
                      schema.as_strategy(schemathesis.GenerationMode.NEGATIVE))
    seen: list[int] = []
    start = time.monotonic()

    @given(case=cases)
    @settings(max_examples=CASES, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    def one(case):
        if time.monotonic() - start > WALL_S:
            return  # the bound holds on a slow machine too (the cases so far still count)
        response = case.call(headers=AUTH, timeout=30)
        seen.append(response.status_code)
        case.validate_response(response, checks=[not_a_server_error])

    one()
    assert len(seen) >= 20 and all(s < 500 for s in seen)
    assert any(s == 200 for s in seen) and any(400 <= s < 500 for s in seen)  # both kinds were reached
    status, r = post(server.url, {"model": server.served.name, "prompt": "Once upon a time", "max_tokens": 3},
                     KEY, "/v1/completions")
    assert status == 200 and r["usage"]["completion_tokens"] == 3
