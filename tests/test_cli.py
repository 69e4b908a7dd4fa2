"""The command line through Typer's CliRunner: outputs, JSON lines, one-line errors."""

import json
import shutil

import pytest
from typer.testing import CliRunner

from mlxkv_cli.main import build_app

runner = CliRunner()
APP = build_app()


def run(*args, input=None):
    return runner.invoke(APP, list(args), input=input)


def jsonl(result):
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def test_version():
    r = run("--version")
    assert r.exit_code == 0 and r.stdout.startswith("mlxkv ") and "mlx-lm" in r.stdout


def test_default_model_needs_no_flags():
    r = run("generate", "Once upon a time", "-n", "24")
    assert r.exit_code == 0, r.output
    assert "Lily" in r.stdout  # the trained model's well-known continuation
    assert "tok/s" in r.stderr and "attention:" in r.stderr


def test_json_lines_with_4bit_kv():
    r = run("generate", "Once upon a time", "--kv-bits", "4", "--kv-group-size", "32",
            "--quantized-kv-start", "0", "--json", "-n", "40")
    assert r.exit_code == 0, r.output
    completion, summary = jsonl(r)
    assert completion["type"] == "completion" and len(completion["token_ids"]) == completion["generated_tokens"]
    assert summary["type"] == "summary" and summary["converted"] is True
    assert summary["attention_path"].startswith("mlxkv-")
    assert [p["bits"] for p in summary["plan"]] == [4] * 5
    assert summary["bits_per_element"] < 32  # some blocks are stored at 4 bits
    assert set(summary["versions"]) == {"mlxkv", "mlx", "mlx_lm"}


def test_start_beyond_the_run_gives_a_notice_and_converted_false():
    r = run("generate", "Once upon a time", "--kv-bits", "4", "--json", "-n", "8")
    assert r.exit_code == 0
    assert "stays full precision" in r.stderr
    assert jsonl(r)[-1]["converted"] is False


def test_prompt_from_stdin_and_file(tmp_path):
    a = run("generate", "-", "-n", "10", "--json", input="Once upon a time")
    f = tmp_path / "story.txt"
    f.write_text("Once upon a time")
    b = run("generate", "--prompt-file", str(f), "-n", "10", "--json")
    c = run("generate", "--profile", "q4", "--prompt-file", str(f), "-n", "10", "--json")
    assert a.exit_code == b.exit_code == c.exit_code == 0
    assert jsonl(a)[0]["token_ids"] == jsonl(b)[0]["token_ids"]
    assert jsonl(c)[-1]["kv_policy"]["codec"] == "affine:4/g64"


def test_stop_string_cuts_the_text():
    r = run("generate", "Once upon a time", "-n", "60", "--stop", "Lily", "--json")
    completion = jsonl(r)[0]
    assert completion["finish_reason"] == "stop" and "Lily" not in completion["text"]


def test_repo_id_from_the_local_hub_cache(tmp_path, monkeypatch, default_model_dir):
    snap = tmp_path / "hub" / "models--tiny--stories" / "snapshots" / "abc123"
    shutil.copytree(default_model_dir, snap)
    (tmp_path / "hub" / "models--tiny--stories" / "refs").mkdir()
    (tmp_path / "hub" / "models--tiny--stories" / "refs" / "main").write_text("abc123")
    import huggingface_hub.constants as hub  # read at import time, so patch the constant

    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    r = run("generate", "-m", "tiny/stories", "Once upon a time", "-n", "5", "--json")
    assert r.exit_code == 0, r.output
    assert jsonl(r)[-1]["model"] == "tiny/stories"
    r = run("generate", "-m", "tiny/absent", "x", "--offline")  # never downloads: today's one-line error
    assert r.exit_code == 1 and "not available locally" in r.stderr


BAD = [
    (["generate", "x", "--kv-bits", "7"], "--kv-bits"),
    (["generate", "x", "--kv-bits", "four"], "--kv-bits"),
    (["generate", "x", "--kv-group-size", "48", "--kv-bits", "4"], "--kv-group-size"),
    (["generate", "--prompt-file", "/no/such/prompt.txt"], "prompt file not found"),
    (["generate", "x", "--kv-config", "/no/such.json"], "kv_config file not found"),
    (["generate", "x", "--profile", "nope"], "unknown profile"),
    (["generate", "x", "-m", "/no/such/model"], "model not found"),
    (["generate", "x", "--dtype", "float8"], "unknown dtype"),
    (["generate", "x", "--temp", "-1"], "--temp"),
    (["generate", "x", "--bogus"], "No such option"),
    (["generate", "x", "-p", "y"], "give the prompt once"),
    (["generate"], "no prompt"),
]


@pytest.mark.parametrize("args,message", BAD)
def test_bad_input_is_one_line_and_nonzero(args, message):
    r = run(*args)
    assert r.exit_code != 0
    assert message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output


def test_malformed_kv_config_via_cli(tmp_path):
    p = tmp_path / "kv.json"
    p.write_text(json.dumps([{"layer_idx": 0, "bits": 4}, {"layer_idx": 0, "bits": 8}]))
    r = run("generate", "x", "--kv-config", str(p))
    assert r.exit_code == 1 and "duplicates entry 0" in r.stderr
