"""generate and friends: flags never accepted and ignored, dtype names, the embedded model's
stop at BOS, the trained-context notice, one prompt-id convention, the embedded model by name."""

import json

import pytest
from typer.testing import CliRunner

from kvcore.errors import MlxkvError
from kvcore.models import EMBEDDED, context_notice, load_model, resolve_model_path
from kvcore.policy import KVOptions, resolve_policy
from mlxkv_cli.main import build_app

APP = build_app()


def run(*args, input=None):
    return CliRunner().invoke(APP, [str(a) for a in args], input=input)


def jsonl(r):
    return [json.loads(x) for x in r.stdout.splitlines() if x.strip()]


@pytest.mark.parametrize("args,message", [
    (["--kv-group-size", "32"], "--kv-group-size 32 needs --kv-bits"),
    (["--kv-bits", "4", "--kv-group-size", "0"], "--kv-group-size must be one of [32, 64, 128], got 0"),
    (["--kv-keep", "2"], "--kv-keep 2 needs --max-kv-size"),
    (["--kv-bits", "4", "--kv-config", "kv.json"], "--kv-config sets each layer's bits and group"),
    (["--kv-group-size", "32", "--kv-config", "kv.json"], "--kv-config sets each layer's bits and group"),
    (["--draft", "prompt-lookup", "--draft-model", "x"], "--draft prompt-lookup drafts without a second model"),
    (["--draft", "prompt-lookup", "--draft-kv-bits", "4"], "--draft-kv-bits needs --draft-model"),
    (["--draft-model", "x", "--draft-kv-bits", "7"], "--draft-kv-bits must be 0 (full precision) or one of"),
    (["--temp", "nan"], "--temp must be a finite number >= 0, got nan"),
    (["--temp", "inf"], "--temp must be a finite number >= 0, got inf"),
    (["--dtype", "fp8"], "unknown dtype 'fp8' (choose from float32, float16, bfloat16, fp32, fp16, bf16)"),
])
def test_flags_without_their_companion_are_one_line_errors(tmp_path, args, message):
    (tmp_path / "kv.json").write_text(json.dumps([{"layer_idx": 0, "bits": 4}]))
    args = [str(tmp_path / a) if a == "kv.json" else a for a in args]
    r = run("generate", "Once", "-n", "2", *args)
    assert r.exit_code == 1 and message in r.stderr, r.output
    assert len(r.stderr.strip().splitlines()) == 1 and not r.stdout


def test_convert_kv_refuses_bits_beside_a_kv_config(tmp_path):
    (tmp_path / "kv.json").write_text(json.dumps([{"layer_idx": 0, "bits": 4}]))
    r = run("convert-kv", tmp_path / "a.kv", tmp_path / "b.kv", "--kv-config", tmp_path / "kv.json", "--kv-bits", "8")
    assert r.exit_code == 1 and "--kv-config sets each layer's bits" in r.stderr


def test_companions_that_mean_something_still_resolve():
    assert resolve_policy(KVOptions(profile="q4", kv_group_size=32)).codec.group_size == 32  # the profile has bits
    assert resolve_policy(KVOptions(max_kv_size=64, keep=2)).keep == 2
    with pytest.raises(MlxkvError, match="needs --kv-bits"):
        resolve_policy(KVOptions(profile="full", kv_group_size=32))


def test_dtype_aliases_as_kv_spells_them():
    r = run("generate", "Once upon a time", "-n", "4", "--dtype", "fp16", "--json")
    assert r.exit_code == 0, r.output
    lm = load_model(None, "bf16")
    assert str(lm.model.parameters()["model"]["norm"]["weight"].dtype) == "mlx.core.bfloat16"


def test_embedded_model_stops_at_bos_with_one_context_notice():
    """TinyStories separates stories with BOS (id 1): the model ends one with it and stops there.
    Asking for more than its trained context (512) gets one notice in mlxkv's words."""
    r = run("generate", "Once upon a time", "-n", "600", "--json")
    assert r.exit_code == 0, r.output
    c = jsonl(r)[0]
    assert c["finish_reason"] == "eos" and c["generated_tokens"] < 500
    assert 1 not in c["token_ids"] and "<s>" not in c["text"]
    assert {1, 2} <= set(load_model().tokenizer.eos_token_ids)
    assert r.stderr.count("trained context of 512") == 1, r.stderr
    assert "Token indices sequence length" not in r.output  # the tokenizer's own warning stays quiet
    assert "trained context" not in run("generate", "Once upon a time", "-n", "8").stderr


def test_context_notice_counts_prompt_and_max_tokens():
    config = {"max_position_embeddings": 512}
    assert context_notice(config, [100 + 400]) is None and context_notice({}, [10**6]) is None
    one = context_notice(config, [5 + 600])
    assert one.startswith("prompt + max tokens = 605 tokens run past the model's trained context of 512")
    assert context_notice(config, [600, 100, 700]).startswith("2 of 3 rows (prompt + max tokens up to 700 tokens)")
    assert context_notice({"text_config": {"max_position_embeddings": 8}}, [9]) is not None


def test_prompt_ids_follow_one_convention(tmp_path):
    """Rows without an id are numbered by position from 0: -p rows and --prompts-file lines alike."""
    f = tmp_path / "rows.txt"
    f.write_text("Once upon a time\n\nThe dog\n")
    j = tmp_path / "rows.jsonl"
    j.write_text('{"prompt": "Once upon a time"}\n{"prompt": "The dog", "id": "b"}\n')
    ids = {}
    for name, args in (("-p", ["-p", "Once upon a time", "-p", "The dog"]), ("text", ["--prompts-file", f]),
                       ("jsonl", ["--prompts-file", j])):
        r = run("generate", *args, "-n", "2", "--json")
        assert r.exit_code == 0, r.output
        ids[name] = [x["id"] for x in jsonl(r) if x["type"] == "completion"]
    assert sorted(ids["-p"]) == sorted(ids["text"]) == ["0", "1"] and sorted(ids["jsonl"]) == ["0", "b"]


@pytest.mark.parametrize("name", ["embedded", "stories260K", EMBEDDED])
def test_the_embedded_model_has_a_name(name, tmp_path):
    path, source = resolve_model_path(name)
    assert source == EMBEDDED and path == resolve_model_path(None)[0]
    out = tmp_path / "c.kv"
    assert run("generate", "Once", "-n", "2", "--save-cache", out).exit_code == 0
    r = run("inspect-cache", out, "-m", name)
    assert r.exit_code == 0 and "model check" in r.stdout.lower(), r.output


def test_extra_eos_tokens_stop_a_row():
    """mlx-lm's --extra-eos-token, at load: a token string or an id; an unknown token is one line."""
    from kvcore.distributed import load_for_run

    from kvcore.engine import GenerateConfig, Request, generate_one
    from kvcore.policy import build_caches

    lm, _ = load_for_run(None, None, "extra-eos", ("▁Lily", "13"))
    lily = lm.tokenizer.convert_tokens_to_ids("▁Lily")
    assert {1, 2, 13, lily} <= set(lm.tokenizer.eos_token_ids)
    ids = lm.tokenizer.encode("Once upon a time")
    c = generate_one(lm.model, lm.tokenizer, Request(tuple(ids), 40), build_caches(lm.model, resolve_policy(KVOptions()))[0],
                     GenerateConfig())
    assert c.finish_reason == "eos" and c.eos_token in (lily, 13) and len(c.token_ids) < 40
    with pytest.raises(MlxkvError, match="--extra-eos-token 'no-such-token' is not a token of this tokenizer"):
        load_model(None, None, ("no-such-token",))


def test_extra_eos_token_ends_rows_alone_and_batched():
    """--extra-eos-token (mlx-lm's flag): '.' ends the embedded model's sentences, one row or several."""
    import json as _json

    for args in (["Once upon a time"], ["-p", "Once upon a time", "-p", "Tom and"]):
        r = run("generate", *args, "-n", "60", "--json", "--extra-eos-token", ".")
        rows = [o for o in map(_json.loads, r.stdout.splitlines()) if o["type"] == "completion"]
        assert rows and all(o["finish_reason"] == "eos" and "." not in o["text"] for o in rows), r.stdout
