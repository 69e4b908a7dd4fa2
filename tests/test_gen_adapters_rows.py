"""Per-row adapters (issue 18): rows of a --prompts-file name their own LoRA adapter folder; each
row's output equals its run alone (greedy, token-exact), batched, compressed and speculative;
an adapter for another model, or a folder that is not one, is a one-line error."""

import json

import pytest
from fixtures.lora import make_adapter
from typer.testing import CliRunner

from kvcore.adapter_set import AdapterSet
from kvcore.engine import Engine, GenerateConfig, Request, generate_one
from kvcore.errors import MlxkvError
from kvcore.models import load_model
from kvcore.policy import KVOptions, build_caches, resolve_policy
from mlxkv_cli.main import build_app

PROMPTS = ["Once upon a time", "The dog ran", "She liked to play", "Tom and Lily"]
N = 10


@pytest.fixture(scope="module")
def setup(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("row-adapters")
    m = tiny_models("llama")
    a1 = make_adapter(m, root / "a1", seed=0)
    a2 = make_adapter(m, root / "a2", rank=2, seed=1, keys=["self_attn.v_proj", "mlp.down_proj"])  # other layers
    return str(m), str(a1), str(a2), root


def cli(args, ok=True):
    r = CliRunner().invoke(build_app(), ["generate", "-n", str(N), "--json", "--no-chat-template"] + args)
    if ok:
        assert r.exit_code == 0, r.output
        return [c["token_ids"] for c in sorted((json.loads(x) for x in r.stdout.splitlines() if '"completion"' in x),
                                          key=lambda c: int(c["id"]))]  # printed as rows finish
    return r


def prompts_file(path, rows):
    path.write_text("".join(json.dumps({"prompt": p, **({"adapter": a} if a else {})}) + "\n" for p, a in rows))
    return str(path)


@pytest.fixture(scope="module")
def alone(setup):
    """Each (prompt, adapter) run alone through --adapter-path (mlx-lm's LoRA layers)."""
    m, a1, a2, _ = setup
    return {(p, a): cli(["-m", m, "-p", p] + (["--adapter-path", a] if a else []))[0]
            for p, a in [(PROMPTS[0], None), (PROMPTS[1], a1), (PROMPTS[2], a2), (PROMPTS[3], None),
                         (PROMPTS[3], a1), (PROMPTS[0], a2), (PROMPTS[0], a1)]}


def test_batched_rows_with_and_without_adapters_equal_each_alone(setup, alone, tmp_path):
    m, a1, a2, _ = setup
    rows = [(PROMPTS[0], None), (PROMPTS[1], a1), (PROMPTS[2], a2), (PROMPTS[3], None)]
    assert len({tuple(alone[r]) for r in rows}) == 4 and alone[(PROMPTS[3], None)] != alone[(PROMPTS[3], a1)]
    f = prompts_file(tmp_path / "rows.jsonl", rows)
    assert cli(["-m", m, "--prompts-file", f]) == [alone[r] for r in rows]
    # rows without their own adapter take --adapter-path; 2 rows a batch: rows join and leave mid-run
    got = cli(["-m", m, "--prompts-file", f, "--adapter-path", a1, "--batch-size", "2"])
    assert got == [alone[(PROMPTS[0], a1)], alone[(PROMPTS[1], a1)], alone[(PROMPTS[2], a2)], alone[(PROMPTS[3], a1)]]


def test_compressed_and_speculative_rows_equal_alone(setup, alone):
    """The engine with 8-bit KV (and prompt-lookup speculation) over an AdapterSet == alone."""
    m, a1, a2, _ = setup
    rows = [(PROMPTS[0], a2), (PROMPTS[3], a1), (PROMPTS[1], a1), (PROMPTS[0], None)]
    lm = load_model(m)
    AdapterSet(lm.model, [a1, a2])
    tok = lm.tokenizer
    reqs = [Request(tuple(tok.encode(p)), N, str(i), adapter=a) for i, (p, a) in enumerate(rows)]
    policy = resolve_policy(KVOptions(kv_bits=8, kv_group_size=32, quantized_kv_start=0))
    engine = Engine(lm.model, tok, policy, 4, GenerateConfig(prefill_chunk=4))
    want = [alone[r] for r in rows]
    assert [c.token_ids for c in engine.run(reqs)] == want
    from kvcore.speculative import PromptLookup, SpecEngine

    spec = SpecEngine(lm.model, tok, policy, PromptLookup(), 3, 4, GenerateConfig(prefill_chunk=4))
    assert [c.token_ids for c in spec.run(reqs)] == want
    # a row naming an adapter the set does not hold, or a model without a set, is one line
    with pytest.raises(MlxkvError, match="not installed"):
        Engine(lm.model, tok, policy, 2).run([Request(reqs[0].prompt_ids, 2, adapter=str(setup[3]))])
    plain = load_model(m)
    with pytest.raises(MlxkvError, match="no per-row adapters"):
        Engine(plain.model, tok, policy, 2).run([reqs[1]])
    c = generate_one(lm.model, tok, reqs[2], build_caches(lm.model, policy)[0])  # one row alone: its adapter
    assert c.token_ids == want[2]


def test_bad_row_adapters_are_one_line(setup, tiny_models, tmp_path):
    m, a1, _, _ = setup
    other = make_adapter(tiny_models("qwen3"), tmp_path / "qwen3-lora")  # another model's shapes
    dora = make_adapter(tiny_models("llama"), tmp_path / "dora")
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "fine_tune_type": "dora"}))
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "adapter_config.json").write_text(json.dumps(cfg))
    (garbage / "adapters.safetensors").write_bytes(b"not safetensors")
    cases = [([(PROMPTS[0], a1), (PROMPTS[1], str(other))], "does not fit this model"),
             ([(PROMPTS[0], str(garbage))], "does not load"),
             ([(PROMPTS[0], None), (PROMPTS[1], str(tmp_path / "missing"))], "line 2: adapter"),
             ([(PROMPTS[0], str(dora)), (PROMPTS[1], None)], "LoRA only")]
    for k, (rows, msg) in enumerate(cases):
        r = cli(["-m", m, "--prompts-file", prompts_file(tmp_path / f"bad{k}.jsonl", rows)], ok=False)
        assert r.exit_code == 1 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output
    bad = tmp_path / "bad-type.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "adapter": 3}) + "\n")
    r = cli(["-m", m, "--prompts-file", str(bad)], ok=False)
    assert r.exit_code == 1 and "adapter must be a folder name" in r.stderr, r.output
