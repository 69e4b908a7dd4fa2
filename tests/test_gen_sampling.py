"""Sampling flags people expect (issue 18): --top-k and --repetition-penalty, per row in batches.

top-k = 1 is greedy token for token (alone, batched, seeded or not); the repetition penalty is
mlx-lm's (its generate_step with make_logits_processors is the reference); rows of one batch
with different settings each equal their run alone.
"""

import json

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors
from typer.testing import CliRunner

from helpers import ROW_PROMPTS, per_family
from kvcore.engine import Engine, GenerateConfig, Request, SamplingConfig, generate_one
from kvcore.errors import MlxkvError
from kvcore.policy import KVOptions, build_caches, resolve_policy
from mlxkv_cli.main import build_app

CHUNK = 8
N = 16


@pytest.fixture(scope="module")
def llama(tiny_models):
    return per_family(tiny_models, lambda path, model, tok: (path, model, tok))("llama")


def alone(model, tok, ids, sampling, n=N, opts=KVOptions()):
    caches, _ = build_caches(model, resolve_policy(opts))
    req = Request(tuple(ids), n, sampling=sampling)
    return generate_one(model, tok, req, caches, GenerateConfig(prefill_chunk=CHUNK)).token_ids


def batched(model, tok, prompts, samplings, n=N, opts=KVOptions()):
    engine = Engine(model, tok, resolve_policy(opts), len(prompts), GenerateConfig(prefill_chunk=CHUNK))
    reqs = [Request(tuple(p), n, str(i), sampling=s) for i, (p, s) in enumerate(zip(prompts, samplings))]
    out = [c.token_ids for c in engine.run(reqs)]
    assert max(len(t[1]) for t in engine.trace if t[0] == "decode") == len(prompts)  # rows shared steps
    return out


def test_top_k_1_is_greedy(llama):
    _, model, tok = llama
    prompts = [tok.encode(p) for p in ROW_PROMPTS[:3]]
    greedy = [alone(model, tok, p, SamplingConfig()) for p in prompts]
    hot = [SamplingConfig(temp=1.5, top_k=1, seed=7), SamplingConfig(temp=0.9, top_k=1), SamplingConfig(temp=2.0, top_k=1, seed=1)]
    assert [alone(model, tok, p, s) for p, s in zip(prompts, hot)] == greedy
    assert batched(model, tok, prompts, hot) == greedy
    # the engine-wide setting (no per-row config) goes through the shared sampler
    engine = Engine(model, tok, resolve_policy(KVOptions()), 3,
                    GenerateConfig(SamplingConfig(temp=1.0, top_k=1), prefill_chunk=CHUNK))
    assert [c.token_ids for c in engine.run([Request(tuple(p), N, str(i)) for i, p in enumerate(prompts)])] == greedy
    # negative control: at this temperature without top-k the draws do leave the greedy path
    assert [alone(model, tok, p, SamplingConfig(temp=2.0, seed=1)) for p in prompts] != greedy


def test_top_k_keeps_the_k_best():
    lp = mx.log(mx.softmax(mx.array([[3.0, 2.9, 2.8, -1.0, 0.5, 2.7]]), axis=-1))
    cfg = SamplingConfig(temp=1.0, top_k=3, seed=0)
    seen = {int(cfg.sample(lp, mx.random.key(i)).item()) for i in range(200)}
    assert seen == {0, 1, 2}
    wide = SamplingConfig(temp=1.0, top_k=99)  # k >= vocabulary: no filter
    assert mx.array_equal(wide.filter(lp), lp).item()


def mlx_lm_penalized(model, ids, penalty, n=N, context=20):
    procs = make_logits_processors(repetition_penalty=penalty, repetition_context_size=context)
    return [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=n, logits_processors=procs)]


@pytest.mark.parametrize("kv", [KVOptions(), KVOptions(kv_bits=8, kv_group_size=32, quantized_kv_start=0)],
                         ids=["full", "affine8"])
def test_repetition_penalty_is_mlx_lm_s_per_row(llama, kv):
    _, model, tok = llama
    prompts = [tok.encode(p) for p in ROW_PROMPTS[:3]]
    settings = [SamplingConfig(repetition_penalty=1.8), SamplingConfig(),
                SamplingConfig(repetition_penalty=1.3, repetition_context_size=6)]
    solo = [alone(model, tok, p, s, opts=kv) for p, s in zip(prompts, settings)]
    if kv == KVOptions():  # mlx-lm's own loop is the reference where its cache is the same
        assert solo[0] == mlx_lm_penalized(model, prompts[0], 1.8)
        assert solo[2] == mlx_lm_penalized(model, prompts[2], 1.3, context=6)
    assert solo[0] != alone(model, tok, prompts[0], SamplingConfig(), opts=kv)  # the penalty bites
    assert batched(model, tok, prompts, settings, opts=kv) == solo


def test_bad_sampling_settings_are_one_line():
    for kw, flag in [({"top_k": -1}, "--top-k"), ({"repetition_penalty": 0.0}, "--repetition-penalty"),
                     ({"repetition_penalty": float("nan")}, "--repetition-penalty"),
                     ({"repetition_context_size": 0}, "--repetition-context-size"), ({"logprobs": -1}, "--logprobs")]:
        with pytest.raises(MlxkvError, match=flag):
            SamplingConfig(**kw)


runner = CliRunner()


def test_cli_top_k_1_equals_greedy_and_errors(llama):
    path = llama[0]
    app = build_app()
    base = ["generate", "-m", path, "-p", "Once upon a time", "-n", "12", "--json", "--no-chat-template"]
    greedy = json.loads(runner.invoke(app, base).stdout.splitlines()[0])["token_ids"]
    topk = runner.invoke(app, base + ["--temp", "1.5", "--top-k", "1", "--seed", "3"])
    assert json.loads(topk.stdout.splitlines()[0])["token_ids"] == greedy
    for extra, msg in [(["--top-k", "-2"], "--top-k"), (["--repetition-penalty", "-1"], "--repetition-penalty"),
                       (["--repetition-penalty", "1.2", "--draft", "prompt-lookup"], "speculative")]:
        r = runner.invoke(app, base + extra)
        assert r.exit_code == 1 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output
    r = runner.invoke(app, base[:-2] + ["--logprobs", "2"])
    assert r.exit_code == 1 and "--logprobs needs --json" in r.stderr
