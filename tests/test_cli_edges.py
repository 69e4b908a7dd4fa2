"""Issue 19's remaining edges: one prompt is held to the batch's checks (batch size, KV budget,
-n past what the budget holds, an empty stop string), fit sizes through the checked config reader,
kv_configs naming layers a model lacks, bench past the trained context, every --help renders."""

import json
import shutil

import pytest
import typer
from typer.testing import CliRunner

from kvcore.engine.memory import batch_need
from kvcore.engine.prompt import encode_prompt
from kvcore.models import load_model
from kvcore.policy import KVOptions, resolve_policy
from kvcore.policy.plan import plan_layers
from mlxkv_cli.bench import context_note
from mlxkv_cli.main import build_app

APP = build_app()
PROMPT = "Once upon a time"
SHAPES = {"one prompt": [PROMPT], "a batch": ["-p", PROMPT, "-p", "The dog"],
          "speculative": [PROMPT, "--draft", "prompt-lookup"]}


def run(*args, input=None):
    return CliRunner().invoke(APP, [str(a) for a in args], input=input)


def one_line_error(r, message: str) -> None:
    assert r.exit_code == 1, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "internal error" not in lines[0], r.stderr


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("args,message", [
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--max-kv-bytes", "bogus"], "--max-kv-bytes: cannot read 'bogus' as a size"),
    (["-n", str(10**12)], "can never fit: its KV needs"),
    (["--stop", ""], "--stop '' is an empty stop string"),
])
def test_every_run_shape_refuses_alike(shape, args, message):
    one_line_error(run("generate", *SHAPES[shape], *args), message)


def test_one_prompt_is_held_to_the_byte_model_of_its_real_cache():
    """The budget check is the batch's byte model: at exactly its figure the row runs and its
    cache stays within it; one byte less and the row is refused before anything runs."""
    lm = load_model(None)
    policy = resolve_policy(KVOptions())
    ids = encode_prompt(lm.tokenizer, PROMPT, None, True)
    need = batch_need(lm.config, plan_layers(lm.model, policy), lm.model, policy, 2048)([len(ids) + 8])
    r = run("generate", PROMPT, "-n", 8, "--max-kv-bytes", need, "--json")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout.splitlines()[-1])
    assert 0 < summary["kv_bytes"] <= need
    one_line_error(run("generate", PROMPT, "-n", 8, "--max-kv-bytes", need - 1),
                   f"the prompt ({len(ids)} tokens) + --max-tokens 8 can never fit")


def test_chat_refuses_an_answer_no_budget_holds():
    one_line_error(run("chat", "-n", 10**12, input=""), "an answer of --max-tokens 1000000000000 can never fit")


# -- fit reads config.json as every command does ---------------------------------------------------
@pytest.mark.parametrize("change,message", [
    ({"num_hidden_layers": None}, "config.json: 'num_hidden_layers' is missing"),
    ({"num_attention_heads": None}, "config.json: 'num_attention_heads' is missing"),
    ({"head_dim": None, "hidden_size": None}, "'hidden_size' (or 'head_dim') is missing"),
    ({"num_key_value_heads": "4"}, "'num_key_value_heads' must be a positive integer, got '4'"),
    ({"num_hidden_layers": 0}, "'num_hidden_layers' must be a positive integer, got 0"),
    ({"model_type": None}, "'model_type' must be a non-empty string"),
])
@pytest.mark.parametrize("json_out", [False, True])
def test_fit_names_a_missing_or_bad_field(tmp_path, default_model_dir, change, message, json_out):
    model = tmp_path / "model"
    shutil.copytree(default_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    for key, value in change.items():
        config.pop(key) if value is None else config.__setitem__(key, value)
    (model / "config.json").write_text(json.dumps(config))
    r = run("fit", "-m", model, "--memory", "1GB", *(["--json"] if json_out else []))
    one_line_error(r, message)
    assert str(model) in r.stderr


# -- kv_configs against the model's layers ------------------------------------------------------------
@pytest.mark.parametrize("args,layer,message", [
    (["fit", "--memory", "1GB", "--kv-config", "{cfg}"], 99, "kv_config: layer_idx 99 out of range (model has 5 layers)"),
    (["fit", "--memory", "1GB", "--kv", "full,config:{cfg}"], 5, "layer_idx 5 out of range (model has 5 layers)"),
    (["fit", "--memory", "24GB", "--shape", "qwen3.5-mini", "--kv-config", "{cfg}"], 0,
     "kv_config: layer_idx 0 holds no KV cache of its own"),
    (["fidelity", "--kv", "full,config:{cfg}", "--window-tokens", "32", "--no-baselines"], 99,
     "kv_config: layer_idx 99 out of range (model has 5 layers)"),
])
def test_a_kv_config_naming_layers_the_model_lacks(tmp_path, args, layer, message):
    cfg = tmp_path / "kv.json"
    cfg.write_text(json.dumps([{"layer_idx": layer, "bits": 4}]))
    r = run(*[a.format(cfg=cfg) for a in args])
    one_line_error(r, message)
    assert not r.stdout  # fidelity printed a table with the error in a cell, and exited 0


def test_fit_takes_a_kv_config_the_model_has(tmp_path):
    cfg = tmp_path / "kv.json"
    cfg.write_text(json.dumps([{"layer_idx": 4, "bits": 4}]))
    r = run("fit", "--memory", "1GB", "--kv-config", cfg, "--json")
    assert r.exit_code == 0, r.output
    assert {row["scheme"] for row in json.loads(r.stdout)["rows"]} >= {"kv_config"}


def test_bench_past_the_trained_context_says_so():
    config = load_model(None).config  # trained for 512 tokens
    note = context_note(config, (256, 520), 2)
    assert note.startswith("--context 520 + --gen 2 = 522 tokens run past the model's trained context of 512 tokens")
    assert context_note(config, (256, 510), 2) is None


# -- the command line itself -------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["generate", "chat", "serve", "bench", "fit", "fidelity", "calibrate",
                                     "convert-kv", "convert-model", "inspect-cache"])
def test_every_help_renders(command):
    r = run(command, "--help")  # calibrate's '[/gG...]' was read as rich markup: an internal error
    assert r.exit_code == 0 and "Usage: " in r.stdout and "--help" in r.stdout, r.output


def _params(command: str) -> dict:
    return {p.name: p for p in typer.main.get_command(APP).commands[command].params}


def test_generate_and_chat_share_one_definition_of_each_flag():
    gen, chat = _params("generate"), _params("chat")
    for name in ("temp", "top_p", "min_p", "top_k", "seed", "prefill_chunk", "model", "dtype", "kv"):
        g, c = gen[name], chat[name]
        assert (g.opts, g.help, g.default) == (c.opts, c.help, c.default), name
    for name, help_text in (("max_tokens", "Most tokens per answer."),
                            ("system_prompt", "System message of the conversation.")):
        assert chat[name].opts == gen[name].opts and chat[name].help == help_text  # chat's own words
    assert gen["max_tokens"].opts == ["--max-tokens", "-n"] and gen["max_tokens"].help == "Tokens to generate."
    fid, cal = _params("fidelity"), _params("calibrate")
    assert fid["text"].opts == cal["text"].opts == ["--text", "-t"] and cal["text"].required
    assert "offline" in cal  # calibrate -m org/repo downloads as every command does
