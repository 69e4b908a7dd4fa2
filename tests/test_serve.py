"""`mlxkv serve` through the official openai client against a real server on a free port: a
qwen3 fixture (head_dim 64) with 4-bit KV compressing from token 0, batch 4."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import ROW_PROMPTS
from serve_helpers import get, metric, post
from kvcore.engine import GenerateConfig, Request, SamplingConfig, generate_one
from kvcore.policy import KVOptions, build_caches
from kvcore.serve import ServeConfig, start_server
from kvcore.serve.server import EXTRA_MODULES

for _extra in EXTRA_MODULES:  # the serve extra; without it (the device image) the module skips
    pytest.importorskip(_extra)
openai = pytest.importorskip("openai")  # the dev extra's client
BadRequestError, NotFoundError, OpenAI = openai.BadRequestError, openai.NotFoundError, openai.OpenAI

KEY = "sk-test"
CHUNK = 8
KV = KVOptions(kv_bits=4, kv_group_size=64, quantized_kv_start=0)
PROMPTS = ROW_PROMPTS + ["A big cat sat on the mat and", "Lily and Ben went to the", "Once upon a time",
                         "The sun was hot. The little bird flew over the green hill and saw"]


@pytest.fixture(scope="module")
def server(tiny_models):
    h = start_server(ServeConfig(model=str(tiny_models("qwen3")), kv=KV, port=0, batch_size=4, api_key=KEY,
                                 prefill_chunk=CHUNK, max_queue=16))
    yield h
    h.stop()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def alone(server, prompt: str, n: int, sampling: SamplingConfig | None = None):
    """(text, token count, compressed?) of `mlxkv generate`'s path for this prompt alone."""
    c, caches = alone_completion(server, prompt, n, sampling)
    return c.text, len(c.token_ids), any(getattr(x, "key_codec", None) is not None for x in caches)


def alone_completion(server, prompt: str, n: int, sampling: SamplingConfig | None = None):
    """(Completion, caches) of generate_one on fresh caches (the same model and KV policy) for this
    prompt alone, run on the server's engine thread."""
    served = server.served

    def run(_engine):
        ids = served.tokenizer.encode(prompt)
        caches = build_caches(served.lm.model, served.policy)[0]
        return generate_one(served.lm.model, served.tokenizer, Request(tuple(ids), n, sampling=sampling), caches,
                            GenerateConfig(prefill_chunk=CHUNK)), caches

    return server.worker.call(run).result(timeout=60)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list()] == [server.served.name]
    assert get(server.url, "/health") == (200, {"status": "ok"})  # no key needed


def test_completion_and_chat_return_the_engine_alone_result(server, client):
    text, n, compressed = alone(server, PROMPTS[0], 12)
    assert compressed and n == 12
    r = client.completions.create(model=server.served.name, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert r.choices[0].text == text and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(server.served.tokenizer.encode(PROMPTS[0])), 12, len(server.served.tokenizer.encode(PROMPTS[0])) + 12)
    # no chat template: one user message is the prompt itself (as `mlxkv generate -p` encodes it)
    c = client.chat.completions.create(model=server.served.name, messages=[{"role": "user", "content": PROMPTS[0]}],
                                       max_completion_tokens=12, temperature=0)
    assert c.choices[0].message.content == text and c.choices[0].message.role == "assistant"
    assert c.usage.completion_tokens == 12 and c.usage.prompt_tokens == r.usage.prompt_tokens


def test_streaming_matches_non_streaming(server, client):
    text, _, _ = alone(server, PROMPTS[2], 10)
    chunks = list(client.chat.completions.create(
        model=server.served.name, messages=[{"role": "user", "content": PROMPTS[2]}], max_tokens=10, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    parts = list(client.completions.create(model=server.served.name, prompt=PROMPTS[2], max_tokens=10,
                                           temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == text and parts[-1].choices[0].finish_reason == "length"


def test_stop_strings_cut_the_text(server, client):
    full, _, _ = alone(server, PROMPTS[1], 24)
    stop = full[8:11]
    cut = full[: full.find(stop)]
    r = client.completions.create(model=server.served.name, prompt=PROMPTS[1], max_tokens=24, temperature=0,
                                  stop=[stop, "never-seen"])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=server.served.name, prompt=PROMPTS[1], max_tokens=24, temperature=0,
                                         stop=stop, stream=True)
    assert "".join(p.choices[0].text for p in streamed) == cut  # held-back text never leaks past a stop


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(server, client):
    def sample(seed):
        return client.completions.create(model=server.served.name, prompt=PROMPTS[3], max_tokens=16,
                                         temperature=1.5, seed=seed).choices[0].text

    lone = {s: sample(s) for s in (1, 2, 3)}
    assert len(set(lone.values())) > 1  # the seed matters
    with ThreadPoolExecutor(6) as pool:  # seeded rows among greedy ones, joining a running batch
        others = [pool.submit(client.completions.create, model=server.served.name, prompt=p, max_tokens=20,
                              temperature=0) for p in PROMPTS[4:7]]
        batched = {s: pool.submit(sample, s) for s in (1, 2, 3)}
        assert {s: f.result() for s, f in batched.items()} == lone
        assert all(f.result().choices[0].text for f in others)


def test_concurrent_greedy_requests_equal_each_alone_and_share_steps(server, client):
    lengths = [12 + 3 * i for i in range(len(PROMPTS))]
    want = [alone(server, p, n)[:2] for p, n in zip(PROMPTS, lengths)]
    barrier = threading.Barrier(len(PROMPTS))

    def ask(i):
        barrier.wait()
        r = client.completions.create(model=server.served.name, prompt=PROMPTS[i], max_tokens=lengths[i],
                                      temperature=0)
        return r.choices[0].text, r.usage.completion_tokens

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(ask, range(len(PROMPTS))))
    assert got == want
    status, text = get(server.url, "/metrics", KEY)
    assert status == 200
    assert metric(text, "running_rows_peak") == 4  # rows really shared decode steps, at most the batch size
    assert metric(text, "running_rows") == 0 and metric(text, "waiting_rows") == 0
    assert metric(text, "requests_in_flight") == 0
    assert 0 < metric(text, "kv_bytes_peak") <= metric(text, "kv_budget_bytes")
    assert metric(text, "generated_tokens_total") >= sum(lengths)


BASE = {"messages": [{"role": "user", "content": "Tom"}], "max_tokens": 2}


@pytest.mark.parametrize("body,status,param", [
    (b'{"model": "m", "messages": [', 400, None),
    ({"max_tokens": "5"}, 400, "max_tokens"),
    ({"max_tokens": -1}, 400, "max_tokens"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ({"temperature": 3}, 400, "temperature"),
    ({"repetition_penalty": float("inf")}, 400, "repetition_penalty"),  # JSON's Infinity, caught by the engine's check
    ({"max_tokens": 0}, 200, None),  # allowed: an empty completion
    ({"stream": "yes"}, 400, "stream"),
    ({"frobnicate": 1}, 400, "frobnicate"),
    ({"n": 0}, 400, "n"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({"presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"frequency_penalty": "1"}, 400, "frequency_penalty"),
    ({"logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"logit_bias": {"cat": 1}}, 400, "logit_bias"),
    ({"logit_bias": {"5000000": 1}}, 400, "logit_bias"),  # outside the vocabulary
    ({"logit_bias": [1, 2]}, 400, "logit_bias"),
    ({"max_tokens": 600}, 400, "messages"),  # past the model's 512-token context
    ({"model": "gpt-4o"}, 404, "model"),
    (b"[1, 2]", 400, None),
])
def test_bad_requests_get_openai_errors_and_the_server_goes_on(server, body, status, param):
    if isinstance(body, dict):
        body = {"model": server.served.name, **BASE, **body}
    got, err = post(server.url, body, KEY)
    if status == 200:
        assert got == 200 and err["choices"][0]["message"]["content"] == "" and err["usage"]["completion_tokens"] == 0
        return
    assert got == status and set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["param"] == param and err["error"]["message"]
    ok, r = post(server.url, {"model": server.served.name, **BASE}, KEY)
    assert ok == 200 and r["usage"]["completion_tokens"] == 2


def test_prompt_beyond_the_context_and_bad_token_ids(server, client):
    with pytest.raises(BadRequestError) as e:
        client.completions.create(model=server.served.name, prompt=[5] * 520, max_tokens=1)
    assert e.value.code == "context_length_exceeded" and "512" in e.value.message
    with pytest.raises(BadRequestError, match="outside the vocabulary"):
        client.completions.create(model=server.served.name, prompt=[5, 100000], max_tokens=1)
    with pytest.raises(NotFoundError):
        client.completions.create(model="nope", prompt="Tom", max_tokens=1)
    r = client.completions.create(model=server.served.name, prompt=[1, 5, 6, 7], max_tokens=3, temperature=0)
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 3


def test_body_limit_and_api_key(server):
    status, err = post(server.url, b"x" * (10 * 2**20), KEY)
    assert status == 413 and err["error"]["code"] == "request_too_large"
    assert post(server.url, {"model": server.served.name, **BASE}, "wrong")[0] == 401
    status, err = post(server.url, {"model": server.served.name, **BASE}, None)
    assert status == 401 and err["error"]["code"] == "invalid_api_key"
    assert get(server.url, "/metrics")[0] == 401 and get(server.url, "/v1/models", "wrong")[0] == 401
    status, err = get(server.url, "/v1/nothing-here", KEY)
    assert status == 404 and err["error"]["message"].startswith("Unknown path")
    assert post(server.url, {"model": server.served.name, **BASE}, KEY)[0] == 200


def test_top_k_1_is_greedy_and_a_penalty_is_honoured(server, client):
    greedy = alone(server, PROMPTS[5], 12)[0]
    r = client.completions.create(model=server.served.name, prompt=PROMPTS[5], max_tokens=12, temperature=1.5,
                                  seed=3, extra_body={"top_k": 1})
    assert r.choices[0].text == greedy
    with pytest.raises(BadRequestError) as e:
        client.completions.create(model=server.served.name, prompt="Tom", max_tokens=2,
                                  extra_body={"repetition_penalty": -1})
    assert e.value.param == "repetition_penalty"


def test_logprobs_in_both_shapes(server, client):
    text, n, _ = alone(server, PROMPTS[4], 8)
    c = client.chat.completions.create(model=server.served.name, messages=[{"role": "user", "content": PROMPTS[4]}],
                                       max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    content = c.choices[0].logprobs.content
    assert c.choices[0].message.content == text and len(content) == n
    assert "".join(t.token for t in content) == text
    for t in content:  # greedy: the chosen token is the best of the top 3, which come sorted
        tops = [x.logprob for x in t.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and t.logprob == pytest.approx(tops[0])
        assert t.logprob <= 0
    r = client.completions.create(model=server.served.name, prompt=PROMPTS[4], max_tokens=8, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == text and lp.token_logprobs == pytest.approx([t.logprob for t in content])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(d) <= 2 for d in lp.top_logprobs)
    with pytest.raises(BadRequestError, match="while streaming"):
        client.completions.create(model=server.served.name, prompt="Tom", max_tokens=2, logprobs=1, stream=True)


def test_response_format_json_schema_constrains_the_output(server, client):
    schema = {"type": "string", "enum": ["yes", "no"]}
    r = client.chat.completions.create(
        model=server.served.name, messages=[{"role": "user", "content": PROMPTS[6]}], max_tokens=12, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert json.loads(r.choices[0].message.content) in ("yes", "no") and r.choices[0].finish_reason == "stop"
    with pytest.raises(BadRequestError) as e:
        client.chat.completions.create(model=server.served.name, messages=[{"role": "user", "content": "Tom"}],
                                       response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert e.value.param == "response_format.json_schema.schema"


def test_n_choices_are_rows_of_their_own(server, client):
    greedy, n_tokens, _ = alone(server, PROMPTS[1], 9)
    r = client.completions.create(model=server.served.name, prompt=PROMPTS[1], max_tokens=9, temperature=0, n=3)
    assert [c.text for c in r.choices] == [greedy] * 3 and [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 3 * n_tokens and r.usage.prompt_tokens == len(
        server.served.tokenizer.encode(PROMPTS[1]))

    def one(seed):
        return client.completions.create(model=server.served.name, prompt=PROMPTS[2], max_tokens=10,
                                         temperature=1.5, seed=seed).choices[0].text

    two = client.completions.create(model=server.served.name, prompt=PROMPTS[2], max_tokens=10, temperature=1.5,
                                    seed=5, n=2)
    assert [c.text for c in two.choices] == [one(5), one(6)]  # choice i draws from seed + i
    chunks = list(client.chat.completions.create(
        model=server.served.name, messages=[{"role": "user", "content": PROMPTS[2]}], max_tokens=10,
        temperature=1.5, seed=5, n=2, stream=True))
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in range(2)]
    assert texts == [one(5), one(6)]


def test_penalties_and_logit_bias_per_row_equal_each_alone(server, client):
    greedy = alone_completion(server, PROMPTS[0], 14)[0]
    banned = greedy.token_ids[0]
    asks = [({"presence_penalty": 2.0, "frequency_penalty": 2.0}, SamplingConfig(presence_penalty=2.0, frequency_penalty=2.0)),
            ({"frequency_penalty": 1.2}, SamplingConfig(frequency_penalty=1.2)),
            ({"logit_bias": {str(banned): -100}, "presence_penalty": -0.5},
             SamplingConfig(logit_bias={banned: -100}, presence_penalty=-0.5)),
            ({"temperature": 1.3, "seed": 4, "frequency_penalty": 0.8},
             SamplingConfig(temp=1.3, seed=4, frequency_penalty=0.8))]
    prompt = PROMPTS[0]
    outs = [alone_completion(server, prompt, 14, cfg)[0] for _, cfg in asks]
    want = [c.text for c in outs]
    assert len(set(want)) == len(want) and greedy.text not in want  # each setting bites
    assert banned not in outs[2].token_ids
    barrier = threading.Barrier(len(asks) + 2)

    def ask(kw):
        barrier.wait()
        return client.completions.create(model=server.served.name, prompt=prompt, max_tokens=14,
                                         **{"temperature": 0, **kw}).choices[0].text

    with ThreadPoolExecutor(len(asks) + 2) as pool:  # beside two plain greedy rows, in one batch
        plain = [pool.submit(ask, {}) for _ in range(2)]
        got = [pool.submit(ask, kw) for kw, _ in asks]
        assert [f.result() for f in got] == want
        assert [f.result() for f in plain] == [greedy.text] * 2


def test_logit_bias_forces_a_token(server, client):
    tok = server.served.tokenizer
    forced = tok.encode(" cat")[-1]
    for kw in ({"temperature": 0}, {"temperature": 1.5, "seed": 2}):
        r = client.chat.completions.create(model=server.served.name, messages=[{"role": "user", "content": "Tom"}],
                                           max_tokens=6, logit_bias={str(forced): 100}, **kw)
        assert r.choices[0].message.content == tok.decode([forced] * 6) and r.usage.completion_tokens == 6
