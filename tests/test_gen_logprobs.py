"""Log-probabilities (issue 18): each generated token's logprob and the top N, alone, batched and
speculative (the target's distribution), equal to a full-precision teacher-forced reference."""

import json

import mlx.core as mx
import pytest
from typer.testing import CliRunner

from helpers import ROW_PROMPTS, per_family
from kvcore.engine import Engine, GenerateConfig, Request, SamplingConfig, generate_one
from kvcore.fidelity import teacher_forced_logprobs
from kvcore.policy import KVOptions, build_caches, resolve_policy
from kvcore.speculative import PromptLookup, SpecEngine
from mlxkv_cli.main import build_app

CHUNK, N, TOL = 8, 10, 2e-4
FULL = resolve_policy(KVOptions())


@pytest.fixture(scope="module")
def llama(tiny_models):
    return per_family(tiny_models, lambda path, model, tok: (path, model, tok))("llama")


def check_against_reference(model, prompt, completion, n_top):
    ids = list(prompt)
    toks = completion.token_ids
    assert completion.logprobs is not None and len(completion.logprobs) == len(toks) > 0
    ref = teacher_forced_logprobs(model, ids + toks, build_caches(model, FULL)[0], 16)[len(ids) - 1 : len(ids) - 1 + len(toks)]
    chosen = mx.take_along_axis(ref, mx.array(toks)[:, None], axis=-1)[:, 0].tolist()
    for j, (entry, want) in enumerate(zip(completion.logprobs, chosen)):
        assert abs(entry["logprob"] - want) < TOL, (j, entry["logprob"], want)
        assert len(entry["top"]) == n_top
        top_ids = mx.argsort(-ref[j])[:n_top].tolist()
        assert [i for i, _ in entry["top"]] == top_ids
        for i, lp in entry["top"]:
            assert abs(lp - ref[j, i].item()) < TOL
        assert all(a[1] >= b[1] for a, b in zip(entry["top"], entry["top"][1:]))


SETTINGS = [SamplingConfig(logprobs=3), SamplingConfig(temp=1.0, seed=5, logprobs=0),
            SamplingConfig(logprobs=5), SamplingConfig()]


def test_alone_and_batched_match_the_reference(llama):
    _, model, tok = llama
    prompts = [tok.encode(p) for p in ROW_PROMPTS]
    alone = []
    for p, s in zip(prompts, SETTINGS):
        c = generate_one(model, tok, Request(tuple(p), N, sampling=s), build_caches(model, FULL)[0],
                         GenerateConfig(prefill_chunk=CHUNK))
        alone.append(c)
        if s.logprobs is not None:
            check_against_reference(model, p, c, s.logprobs)
        else:
            assert c.logprobs is None and "logprobs" not in c.to_json()
    engine = Engine(model, tok, FULL, 4, GenerateConfig(prefill_chunk=CHUNK))
    out = engine.run([Request(tuple(p), N, str(i), sampling=s) for i, (p, s) in enumerate(zip(prompts, SETTINGS))])
    for p, s, c, a in zip(prompts, SETTINGS, out, alone):
        assert c.token_ids == a.token_ids
        if s.logprobs is not None:
            check_against_reference(model, p, c, s.logprobs)
    assert out[3].logprobs is None


def test_speculative_reports_the_target_distribution(llama):
    _, model, tok = llama
    prompts = [tok.encode(p) for p in ROW_PROMPTS[:3]]
    engine = SpecEngine(model, tok, FULL, PromptLookup(), 4, 3,
                        GenerateConfig(SamplingConfig(logprobs=2), prefill_chunk=CHUNK))
    out = engine.run([Request(tuple(p), N, str(i)) for i, p in enumerate(prompts)])
    assert engine.stats.to_json()["accepted_tokens"] > 0  # drafts were really kept
    for p, c in zip(prompts, out):
        check_against_reference(model, p, c, 2)


def test_cli_json_logprobs(llama):
    path = llama[0]
    r = CliRunner().invoke(build_app(), ["generate", "-m", path, "-p", "Once upon a time", "-p", "The dog", "-n", "5",
                                         "--json", "--logprobs", "2"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in r.stdout.splitlines() if '"completion"' in x]
    assert len(rows) == 2
    for row in rows:
        assert len(row["logprobs"]) == len(row["token_ids"])
        assert all(len(e["top"]) == 2 and e["logprob"] <= 0 for e in row["logprobs"])


def test_logprobs_ride_in_the_one_read_back(llama, monkeypatch):
    from test_engine_sync import SyncCounter

    _, model, tok = llama
    engine = Engine(model, tok, FULL, 3, GenerateConfig(prefill_chunk=CHUNK), interleave=False)
    engine.ignore_eos = True
    for i, (p, s) in enumerate(zip(ROW_PROMPTS[:3], SETTINGS)):
        engine.add_request(Request(tuple(tok.encode(p)), 20, str(i), sampling=s))
    while len(engine.running) < 3 or engine.scheduler.admitting is not None:
        engine.step()
    counter = SyncCounter(monkeypatch)
    steps = []
    for _ in range(8):
        engine.step()
        steps.append(counter.take())
    monkeypatch.undo()
    steady = steps[1:-1]
    assert all(s["readback"] == 1 and s["eval"] == 0 and s["async_eval"] <= 1 for s in steady), steady
    assert all(len(s.out.logprobs) == len(s.out.token_ids) for s in engine.running if s.sampling.logprobs is not None)
