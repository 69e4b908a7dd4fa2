"""Long prompts are prefilled under the memory model's bound (kvcore.transient.PrefillMemory).

A prompt longer than one chunk runs with MLX's memory limit at what is live, plus the row's KV
at its final context, plus one layer's transient: the engine and `generate_one` enter it
themselves when the job hands them the model's config. The tokens are those of an unbounded
run, the limit is the one the plan gives, and the previous limit is back afterwards.
"""

from __future__ import annotations

import importlib
import json

import mlx.core as mx
import pytest
from mlx_lm import load

from kvcore.engine import Engine, GenerateConfig, Request
from kvcore.engine.generate import generate_one
from kvcore.policy import KVOptions, build_caches, resolve_policy
from kvcore.transient import PrefillMemory

CHUNK = 32
fwd = importlib.import_module("kvcore.engine.forward")  # the module (kvcore.engine exports a function of its name)


@pytest.fixture(scope="module")
def llama(tiny_models):
    path = tiny_models("llama")
    model, tok = load(str(path))
    return model, tok, json.loads((path / "config.json").read_text())


def _limit_now() -> int:
    prev = mx.set_memory_limit(1 << 50)  # raised for an instant: nothing waits on it
    mx.set_memory_limit(prev)
    return prev


@pytest.fixture
def limits(monkeypatch):
    """MLX's memory limit at every forward pass of a prefill (read, not changed)."""
    seen = []
    real = fwd.forward

    def spy(model, tokens, caches):
        seen.append((tokens.shape[1], _limit_now()))
        return real(model, tokens, caches)

    monkeypatch.setattr(fwd, "forward", spy)
    return seen


def _prompt(n: int, vocab: int) -> tuple[int, ...]:
    return tuple((7 * i + 3) % (vocab - 4) + 3 for i in range(n))


def test_generate_one_bounds_a_long_prefill_and_gives_the_same_tokens(llama, limits):
    model, tok, cfg = llama
    policy = resolve_policy(KVOptions(kv_bits=4, kv_group_size=32, quantized_kv_start=0))
    req = Request(_prompt(5 * CHUNK + 7, cfg["vocab_size"]), 12, "r")
    before = _limit_now()
    plain = generate_one(model, tok, req, build_caches(model, policy)[0], GenerateConfig(prefill_chunk=CHUNK))
    assert {lim for _, lim in limits} == {before}
    limits.clear()
    memory = PrefillMemory(model, cfg, policy)
    expected = memory.limit(len(req.prompt_ids) + req.max_tokens)
    bounded = generate_one(model, tok, req, build_caches(model, policy)[0],
                           GenerateConfig(prefill_chunk=CHUNK, prefill_memory=memory))
    assert bounded.token_ids == plain.token_ids
    prefill = [lim for n, lim in limits if n > 1]
    assert len(prefill) >= 5 and expected is not None and expected < before
    assert all(abs(lim - expected) <= expected // 50 for lim in prefill)  # live memory moves a little
    assert _limit_now() == before


def test_the_engine_bounds_a_long_row_and_leaves_short_rows_and_decode_alone(llama, limits):
    model, tok, cfg = llama
    policy = resolve_policy(KVOptions(kv_bits=4, kv_group_size=32, quantized_kv_start=0))
    reqs = [Request(_prompt(4 * CHUNK + 3, cfg["vocab_size"]), 8, "long"), Request(_prompt(9, cfg["vocab_size"]), 8, "short")]
    before = _limit_now()
    plain = Engine(model, tok, policy, 2, GenerateConfig(prefill_chunk=CHUNK)).run(reqs)
    limits.clear()
    memory = PrefillMemory(model, cfg, policy)
    bounded = Engine(model, tok, policy, 2, GenerateConfig(prefill_chunk=CHUNK, prefill_memory=memory)).run(reqs)
    assert [c.token_ids for c in bounded] == [c.token_ids for c in plain]
    bounded_calls = [(n, lim) for n, lim in limits if lim != before]
    assert sum(n for n, _ in bounded_calls) == len(reqs[0].prompt_ids)  # the long row's prefill, all of it
    assert any(n == 1 and lim == before for n, lim in limits)  # decode steps run unbounded
    assert _limit_now() == before


def test_a_config_the_plan_cannot_read_leaves_the_prefill_unbounded(llama):
    model, tok, _ = llama
    policy = resolve_policy(KVOptions(kv_bits=4, kv_group_size=32, quantized_kv_start=0))
    memory = PrefillMemory(model, {"model_type": "llama"}, policy)
    assert memory.limit(1000) is None
    out = generate_one(model, tok, Request(_prompt(3 * CHUNK, 200), 4, "r"), build_caches(model, policy)[0],
                       GenerateConfig(prefill_chunk=CHUNK, prefill_memory=memory))
    assert len(out.token_ids) == 4


@pytest.mark.parametrize("mode", ["1", "auto", "0"])
def test_a_bounded_prefill_settles_each_layer_and_gives_the_same_tokens(llama, limits, monkeypatch, mode):
    """Inside the bound each attention call first evaluates the graph before it (`attention/settle.py`: MLX's
    CUDA backend only waits on command graphs committed full, so an open graph held several layers); the
    tokens are those of an unbounded run. `auto` settles on CUDA only, so not here; decode never settles."""
    from kvcore.attention import settle

    model, tok, cfg = llama
    policy = resolve_policy(KVOptions(kv_bits=4, kv_group_size=32, quantized_kv_start=0))
    req = Request(_prompt(4 * CHUNK + 5, cfg["vocab_size"]), 6, "r")
    plain = generate_one(model, tok, req, build_caches(model, policy)[0], GenerateConfig(prefill_chunk=CHUNK))
    limits.clear()
    monkeypatch.setenv("MLXKV_LAYER_SYNC", mode)
    before, unbounded = settle.settled(), _limit_now()
    bounded = generate_one(model, tok, req, build_caches(model, policy)[0],
                           GenerateConfig(prefill_chunk=CHUNK, prefill_memory=PrefillMemory(model, cfg, policy)))
    assert bounded.token_ids == plain.token_ids
    forwards = sum(1 for _, lim in limits if lim != unbounded)  # the prefill's forwards, all under the bound
    expected = forwards * len(model.layers) if mode == "1" else 0
    assert forwards >= 5 and settle.settled() - before == expected
    assert sum(n for n, lim in limits if lim != unbounded) == len(req.prompt_ids)
