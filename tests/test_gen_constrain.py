"""Constrained decoding (issue 18): JSON schema, regex and Lark grammar masks per row, alone,
batched and speculative (llguidance)."""

import json
import os
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from helpers import ROW_PROMPTS, per_family
from kvcore.engine import Engine, GenerateConfig, Request, SamplingConfig, generate_one
from kvcore.engine.constrain import ConstraintSpec, too_old
from kvcore.errors import MlxkvError
from kvcore.models import load_model
from kvcore.policy import KVOptions, build_caches, resolve_policy
from kvcore.speculative import PromptLookup, SpecEngine
from mlxkv_cli.main import build_app

pytest.importorskip("llguidance")  # the constrain extra
jsonschema = pytest.importorskip("jsonschema")  # the dev extra validates what it emits

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}}}
JSON = ConstraintSpec("json_schema", json.dumps(SCHEMA))
REGEX = ConstraintSpec("regex", r"[0-9]{3}-[a-z]{2}")
GRAMMAR = ConstraintSpec("grammar", 'start: answer "." \nanswer: "yes" | "no" | "maybe so"\n')
FULL = resolve_policy(KVOptions())
MLXKV_HOME = Path(os.environ.get("MLXKV_HOME", Path.home() / ".cache/mlxkv"))
SMOL = MLXKV_HOME / "models/SmolLM2-135M-Instruct-f32"


@pytest.fixture(scope="module")
def embedded():
    return load_model(None)


def alone(lm, prompt, sampling, n=60, policy=FULL):
    req = Request(tuple(lm.tokenizer.encode(prompt)), n, sampling=sampling)
    return generate_one(lm.model, lm.tokenizer, req, build_caches(lm.model, policy)[0], GenerateConfig(prefill_chunk=16))


def valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False


def test_sampled_outputs_that_end_validate(embedded):
    """Many sampled rows in one batch: every output that ended by its end token parses and
    validates; outputs cut by the length limit are counted apart (and are prefixes)."""
    lm = embedded
    engine = Engine(lm.model, lm.tokenizer, FULL, 16, GenerateConfig(prefill_chunk=16))
    reqs = [Request(tuple(lm.tokenizer.encode(ROW_PROMPTS[i % 4])), 40, str(i),
                    sampling=SamplingConfig(temp=1.0, seed=i, constraint=JSON)) for i in range(16)]
    out = engine.run(reqs)
    ended = [c for c in out if c.finish_reason == "eos"]
    cut = [c for c in out if c.finish_reason == "length"]
    assert len(ended) + len(cut) == len(out) and len(ended) >= 12, [(c.finish_reason, c.text) for c in out]
    assert all(valid(c.text) for c in ended), [c.text for c in ended if not valid(c.text)]
    assert len({c.text for c in ended}) > 6  # really sampled
    # negative control: unconstrained, the same rows are not JSON
    engine = Engine(lm.model, lm.tokenizer, FULL, 16, GenerateConfig(prefill_chunk=16))
    free = engine.run([Request(r.prompt_ids, 40, r.id, sampling=SamplingConfig(temp=1.0, seed=int(r.id))) for r in reqs[:8]])
    assert not any(valid(c.text) for c in free)


@pytest.mark.parametrize("spec, check", [(REGEX, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
                                         (GRAMMAR, lambda t: t in ("yes.", "no.", "maybe so."))],
                         ids=["regex", "grammar"])
def test_regex_and_grammar(embedded, spec, check):
    for s in (SamplingConfig(constraint=spec), SamplingConfig(temp=1.0, seed=3, constraint=spec)):
        c = alone(embedded, "Once upon a time", s)
        assert c.finish_reason == "eos" and check(c.text), c.text


@pytest.fixture(scope="module")
def llama(tiny_models):
    return per_family(tiny_models, lambda path, model, tok: load_model(path))("llama")


def test_batched_and_speculative_equal_alone(llama):
    """Greedy: constrained and free rows batched == each alone; constrained speculative ==
    constrained plain (drafts that break the constraint are rejected)."""
    lm = llama
    settings = [SamplingConfig(constraint=JSON), SamplingConfig(), SamplingConfig(constraint=REGEX),
                SamplingConfig(constraint=GRAMMAR)]
    policy = resolve_policy(KVOptions(kv_bits=8, kv_group_size=32, quantized_kv_start=0))
    solo = [alone(lm, p, s, 40, policy).token_ids for p, s in zip(ROW_PROMPTS, settings)]
    reqs = [Request(tuple(lm.tokenizer.encode(p)), 40, str(i), sampling=s)
            for i, (p, s) in enumerate(zip(ROW_PROMPTS, settings))]
    engine = Engine(lm.model, lm.tokenizer, policy, 4, GenerateConfig(prefill_chunk=16))
    assert [c.token_ids for c in engine.run(reqs)] == solo
    assert solo[0] != solo[1] and valid(lm.tokenizer.decode(solo[0]))
    spec = SpecEngine(lm.model, lm.tokenizer, policy, PromptLookup(), 4, 4, GenerateConfig(prefill_chunk=16))
    assert [c.token_ids for c in spec.run(reqs)] == solo
    assert spec.stats.to_json()["drafted_tokens"] > 0


def test_bad_constraints_are_one_line(embedded, tmp_path):
    with pytest.raises(MlxkvError, match="not JSON"):
        ConstraintSpec("json_schema", "{not json")
    app, runner = build_app(), CliRunner()
    lark = tmp_path / "bad.lark"
    lark.write_text('start: "a" (\n')
    for args, msg in [(["--json-schema", '{"type": "objec"}'], "--json-schema does not compile"),
                      (["--json-schema", "{nope"], "--json-schema is not JSON"),
                      (["--json-schema", str(tmp_path / "missing.json")], "file not found"),
                      (["--regex", "[a-"], "--regex does not compile"),
                      (["--grammar", str(lark)], "--grammar does not compile"),
                      (["--regex", "a", "--grammar", str(lark)], "give one constraint")]:
        r = runner.invoke(app, ["generate", "-p", "Once", "-n", "4"] + args)
        assert r.exit_code == 1 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.output)


def test_cli_json_schema_file(tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    r = CliRunner().invoke(build_app(), ["generate", "-p", "Once upon a time", "-p", "The dog", "-n", "60", "--json",
                                         "--json-schema", str(schema), "--temp", "0.8", "--seed", "1"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in r.stdout.splitlines() if '"completion"' in x]
    assert len(rows) == 2 and all(valid(x["text"]) for x in rows if x["finish_reason"] == "eos")


@pytest.mark.skipif(not SMOL.is_dir(), reason=f"{SMOL} absent (run scripts/get-eval-model)")
def test_smollm2_sampled_json_validates():
    lm = load_model(str(SMOL))
    from kvcore.engine.prompt import encode_prompt

    ids = tuple(encode_prompt(lm.tokenizer, "Describe a person as JSON with a name, a number and a flag."))
    engine = Engine(lm.model, lm.tokenizer, FULL, 4, GenerateConfig(prefill_chunk=64))
    out = engine.run([Request(ids, 36, str(i), sampling=SamplingConfig(temp=0.8, seed=i, constraint=JSON))
                      for i in range(4)])
    ended = [c for c in out if c.finish_reason == "eos"]
    assert len(ended) >= 3 and all(valid(c.text) for c in ended), [(c.finish_reason, c.text) for c in out]


def test_constrained_masks_are_computed_while_the_next_forward_runs(llama, monkeypatch):
    """A steady constrained step: its masks are built after the previous step queued the forward
    (async_eval) and before this step's one read-back; still one async_eval and one read-back."""
    import mlx.core as mx

    from kvcore.engine.constrain import Constraint

    lm, log = llama, []
    engine = Engine(lm.model, lm.tokenizer, FULL, 3, GenerateConfig(prefill_chunk=16), interleave=False)
    engine.ignore_eos = True
    long = ConstraintSpec("regex", "[a-z ]{200}")
    for i, p in enumerate(ROW_PROMPTS[:3]):
        engine.add_request(Request(tuple(lm.tokenizer.encode(p)), 20, str(i),
                                   sampling=SamplingConfig(constraint=long if i != 1 else None)))
    while len(engine.running) < 3 or engine.scheduler.admitting is not None:
        engine.step()

    def logged(name, real):
        def call(*a, **k):
            log.append(name)
            return real(*a, **k)
        return call
    monkeypatch.setattr(mx, "async_eval", logged("async_eval", mx.async_eval))
    monkeypatch.setattr(mx, "eval", logged("eval", mx.eval))
    monkeypatch.setattr(mx.array, "tolist", logged("readback", mx.array.tolist))
    monkeypatch.setattr(mx.array, "item", logged("readback", mx.array.item))
    monkeypatch.setattr(Constraint, "bits", logged("mask", Constraint.bits))
    steps = []
    for _ in range(8):
        engine.step()
        steps.append(log[:])
        log.clear()
    monkeypatch.undo()
    for s in steps[1:-1]:
        assert s == ["mask", "mask", "readback", "async_eval"], steps


def test_an_llguidance_that_takes_one_eos_token_is_refused_by_version():
    # 1.6 takes one EOS id, so every tokenizer with an EOS list failed deep inside it (seen on the H200's wheels)
    assert too_old("1.6.1") == "1.6.1" and too_old("1.0.0") == "1.0.0"
    assert too_old("1.7.0") is None and too_old("1.9.1") is None and too_old("2.0") is None
    assert too_old(None) is None and too_old("main") is None
