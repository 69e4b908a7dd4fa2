"""OpenAI's presence and frequency penalties and logit_bias, per row (issue 15).

The reference is mlx-lm's own decode loop (generate_step, full-precision cache) with a logits
processor written from OpenAI's definition: the bias added, then
`logit[j] -= frequency * count[j] + presence * (count[j] > 0)` over the generated tokens only.
Rows of one batch with different settings each equal their run alone.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from helpers import ROW_PROMPTS, per_family
from kvcore.engine import Engine, GenerateConfig, Request, SamplingConfig, generate_one
from kvcore.errors import MlxkvError
from kvcore.policy import KVOptions, build_caches, resolve_policy

CHUNK = 8
N = 16


@pytest.fixture(scope="module")
def llama(tiny_models):
    return per_family(tiny_models, lambda path, model, tok: (model, tok))("llama")


def alone(model, tok, ids, sampling, n=N):
    caches, _ = build_caches(model, resolve_policy(KVOptions()))
    return generate_one(model, tok, Request(tuple(ids), n, sampling=sampling), caches,
                        GenerateConfig(prefill_chunk=CHUNK)).token_ids


def openai_reference(model, ids, presence=0.0, frequency=0.0, bias=None, n=N):
    def adjust(tokens, logits):  # tokens: the prompt and what was generated so far
        vocab = logits.shape[-1]
        add = np.zeros(vocab, np.float32)
        for t, b in (bias or {}).items():
            add[t] += b
        logits = logits + mx.array(add)
        counts = np.bincount(np.array(tokens)[len(ids):].astype(np.int64), minlength=vocab).astype(np.float32)
        return logits - mx.array(frequency * counts + presence * (counts > 0))

    return [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=n, logits_processors=[adjust])]


def test_penalties_and_bias_are_openai_s_per_row(llama):
    model, tok = llama
    prompts = [tok.encode(p) for p in ROW_PROMPTS]
    greedy = [alone(model, tok, p, SamplingConfig()) for p in prompts]
    banned = greedy[3][0]
    settings = [SamplingConfig(presence_penalty=1.5), SamplingConfig(frequency_penalty=0.7),
                SamplingConfig(presence_penalty=-1.0, frequency_penalty=2.0),
                SamplingConfig(logit_bias={banned: -100, 7: 3.5}, frequency_penalty=0.5)]
    refs = [openai_reference(model, prompts[0], presence=1.5), openai_reference(model, prompts[1], frequency=0.7),
            openai_reference(model, prompts[2], presence=-1.0, frequency=2.0),
            openai_reference(model, prompts[3], frequency=0.5, bias={banned: -100, 7: 3.5})]
    solo = [alone(model, tok, p, s) for p, s in zip(prompts, settings)]
    assert solo == refs
    assert all(s != g for s, g in zip(solo, greedy))  # every setting bites
    assert banned not in solo[3]
    engine = Engine(model, tok, resolve_policy(KVOptions()), len(prompts), GenerateConfig(prefill_chunk=CHUNK))
    out = engine.run([Request(tuple(p), N, str(i), sampling=s) for i, (p, s) in enumerate(zip(prompts, settings))])
    assert max(len(t[1]) for t in engine.trace if t[0] == "decode") == len(prompts)  # rows shared steps
    assert [c.token_ids for c in out] == solo


def test_a_large_bias_forces_a_token_even_when_sampling(llama):
    model, tok = llama
    ids = tok.encode(ROW_PROMPTS[0])
    forced = 42
    for cfg in (SamplingConfig(logit_bias={forced: 100}), SamplingConfig(temp=1.5, seed=3, logit_bias={forced: 100})):
        assert alone(model, tok, ids, cfg, n=8) == [forced] * 8


def test_the_engine_wide_setting_is_honoured(llama):
    model, tok = llama
    prompts = [tok.encode(p) for p in ROW_PROMPTS[:2]]
    cfg = SamplingConfig(presence_penalty=1.5)
    engine = Engine(model, tok, resolve_policy(KVOptions()), 2, GenerateConfig(cfg, prefill_chunk=CHUNK))
    out = engine.run([Request(tuple(p), N, str(i)) for i, p in enumerate(prompts)])
    assert [c.token_ids for c in out] == [openai_reference(model, p, presence=1.5) for p in prompts]


def test_bad_penalties_and_biases_are_one_line():
    for kw, flag in [({"presence_penalty": 2.5}, "--presence-penalty"),
                     ({"frequency_penalty": float("nan")}, "--frequency-penalty"),
                     ({"logit_bias": {3: 101}}, "--logit-bias"), ({"logit_bias": {-1: 1}}, "--logit-bias"),
                     ({"logit_bias": {"3": 1}}, "--logit-bias")]:
        with pytest.raises(MlxkvError, match=flag):
            SamplingConfig(**kw)
    cfg = SamplingConfig(logit_bias={5: 1, 2: -3})
    assert cfg.logit_bias == ((2, -3.0), (5, 1.0)) and hash(cfg) == hash(SamplingConfig(logit_bias=((5, 1), (2, -3))))
    assert not SamplingConfig().adjusted and cfg.adjusted and SamplingConfig(frequency_penalty=0.1).counted
