"""Chat templates and prefix reuse across requests: a qwen3 fixture given a chat template; a
second chat turn starts from the first turn's cached prompt (4-bit KV from token 0, so the reused
caches are compressed) and returns exactly what the whole prompt prefilled alone returns; the
cache is an LRU bounded by its bytes."""

from __future__ import annotations

import json
import shutil

import pytest
from mlx_lm import load

from serve_helpers import get, metric
from kvcore.backend import backend_name
from kvcore.engine import Engine, GenerateConfig, Request, generate_one
from kvcore.engine.reuse import common_prefix
from kvcore.policy import KVOptions, build_caches, resolve_policy
from kvcore.serve import ServeConfig, start_server
from kvcore.serve.prefix import PrefixCache
from kvcore.serve.prompting import chat_ids
from kvcore.serve.protocol import Message
from kvcore.serve.server import EXTRA_MODULES

CHUNK = 8
KV = KVOptions(kv_bits=4, kv_group_size=64, quantized_kv_start=0)
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('tool turns need tools') }}"
            "{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def openai():
    """The openai client (the dev extra); without it the tests through a server skip (the device image)."""
    return pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    for name in EXTRA_MODULES:
        pytest.importorskip(name)
    folder = tmp_path_factory.mktemp("chat") / "qwen3-chat"
    shutil.copytree(tiny_models("qwen3"), folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    h = start_server(ServeConfig(model=str(folder), kv=KV, port=0, batch_size=2, prefill_chunk=CHUNK,
                                 prefix_cache_bytes=64 * 2**20))
    yield h
    h.stop()


def test_messages_go_through_the_chat_template(openai, server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    tok = server.served.tokenizer
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Tom"}]
    text = "<|system|>Be brief.\n<|user|>Tom\n<|assistant|>"  # developer is the template's system role
    ids = list(tok.encode(text, add_special_tokens=False))
    assert chat_ids(tok, [Message(**m) for m in messages]) == ids
    r = client.chat.completions.create(model=server.served.name, messages=messages, max_tokens=6, temperature=0)
    assert r.usage.prompt_tokens == len(ids) and r.choices[0].message.content == alone(server, ids, 6)
    with pytest.raises(openai.BadRequestError, match="tool turns need tools") as e:
        client.chat.completions.create(model=server.served.name, max_tokens=2,
                                       messages=[{"role": "tool", "content": "42", "tool_call_id": "c1"}])
    assert e.value.param == "messages"


def alone(server, ids: list[int], n: int) -> str:
    served = server.served

    def run(_engine):
        caches = build_caches(served.lm.model, served.policy)[0]
        return generate_one(served.lm.model, served.tokenizer, Request(tuple(ids), n), caches,
                            GenerateConfig(prefill_chunk=CHUNK)).text

    return server.worker.call(run).result(timeout=60)


def test_a_second_turn_reuses_the_first_and_returns_the_same_tokens(openai, server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    name, tok = server.served.name, server.served.tokenizer
    turn1 = [{"role": "user", "content": "Once upon a time there was a little girl named Lily. She liked"}]
    before = get(server.url, "/metrics")[1]
    r1 = client.chat.completions.create(model=name, messages=turn1, max_tokens=8, temperature=0)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "The dog"}]
    ids1 = chat_ids(tok, [Message(**m) for m in turn1])
    ids2 = chat_ids(tok, [Message(**m) for m in turn2])
    shared = common_prefix(ids1, ids2)
    assert shared > 10
    r2 = client.chat.completions.create(model=name, messages=turn2, max_tokens=10, temperature=0)
    assert r2.usage.prompt_tokens == len(ids2) and r2.usage.prompt_tokens_details.cached_tokens == shared
    assert r2.choices[0].message.content == alone(server, ids2, 10)
    text = get(server.url, "/metrics")[1]
    for key, more in (("hits_total", 1), ("reused_tokens_total", shared), ("entries", 2)):  # entries: both turns
        assert metric(text, "prefix_cache_" + key) == metric(before, "prefix_cache_" + key) + more
    assert 0 < metric(text, "prefix_cache_bytes") <= metric(text, "prefix_cache_capacity_bytes")
    kinds = server.worker.call(lambda e: [x.pages is not None for x in e.prefix.entries.values()]).result(timeout=30)
    if backend_name() == "cuda":
        assert not any(kinds)  # CUDA packs its rows: the entries are copies
    else:
        assert kinds and all(kinds)  # the rows page: the entries are the pools' pinned pages, not copies


def test_the_cache_is_an_lru_bounded_by_bytes(tiny_models):
    model, tok = load(str(tiny_models("qwen3")))
    policy = resolve_policy(KV)
    prompts = [tuple(10 + 7 * i + j for j in range(20)) for i in range(4)]  # no shared start

    def engine_with(capacity):
        engine = Engine(model, tok, policy, 2, GenerateConfig(prefill_chunk=CHUNK))
        engine.prefix = PrefixCache(capacity, engine.runner.new_caches)
        return engine

    one = engine_with(2**30)
    one.run([Request(prompts[0], 2, "a")])
    size = one.prefix.nbytes
    assert size > 0 and len(one.prefix.entries) == 1
    engine = engine_with(int(2.5 * size))
    engine.run([Request(p, 2, str(i)) for i, p in enumerate(prompts[:3])])
    assert list(engine.prefix.entries) == [(None, p) for p in prompts[1:3]] and engine.prefix.nbytes <= 2.5 * size  # oldest evicted
    engine.run([Request(prompts[1] + (99,), 2, "again")])  # a hit makes prompts[1] the newest
    assert engine.prefix.hits == 1 and engine.prefix.reused == {"again": len(prompts[1])}
    engine.run([Request(prompts[3], 2, "3")])
    assert list(engine.prefix.entries)[-2:] == [(None, prompts[1] + (99,)), (None, prompts[3])]
    assert (None, prompts[2]) not in engine.prefix.entries and engine.prefix.nbytes <= 2.5 * size
    small = engine_with(size - 1)
    small.run([Request(prompts[0], 2, "big")])
    assert not small.prefix.entries and small.prefix.nbytes == 0  # an entry beyond the bound is not kept
