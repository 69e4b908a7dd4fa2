"""Bad prompts, flags, settings files and model folders: each is one error line naming the problem
(never "internal error", never a silent run from BOS), and nothing is slow for a large valid input."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
from store_helpers import cli, job
from typer.testing import CliRunner

from kvcore.engine.prompts_file import load_prompts_file
from mlxkv_cli.main import build_app

DEEP = 100_000  # nesting depth far past Python's recursion limit


def run(*args, input=None):
    return CliRunner().invoke(build_app(), [str(a) for a in args], input=input)


def one_line_error(r, message: str) -> None:
    assert r.exit_code == 1, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "internal error" not in lines[0], r.stderr


# -- prompts ---------------------------------------------------------------------------------------
def test_empty_prompts_are_refused(tmp_path):
    empty, blank = tmp_path / "empty.txt", tmp_path / "blank.txt"
    empty.write_text("")
    blank.write_text("\n  \n")
    one_line_error(run("generate", "", "-n", "2"), "the prompt is empty")
    one_line_error(run("generate", "-p", "x", "-p", "", "-n", "2"), "-p prompt 1 is empty")
    one_line_error(run("generate", "--prompt-file", empty, "-n", "2"), f"prompt file {empty} is empty")
    one_line_error(run("generate", "--prompt-file", blank, "-n", "2"), "is empty")
    one_line_error(run("generate", "-", "-n", "2", input=""), "stdin is empty")
    one_line_error(run("generate", "--prompt-file", "-", "-n", "2", input="\n"), "stdin is empty")


def test_an_empty_continuation_of_a_loaded_cache_continues_it(tmp_path):
    saved = tmp_path / "c.kv"
    job("Once upon a time", None, 4, save_cache=str(saved))
    r = run("generate", "-p", "", "-n", "3", "--load-cache", saved)
    assert r.exit_code == 0 and r.stdout.strip(), r.output


def test_binary_stdin_is_named():
    one_line_error(run("generate", "-", "-n", "2", input=b"Once \xff\xfe\x00 upon"), "stdin is not UTF-8 text")


# -- flags -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [-1, 2**64])
def test_seed_out_of_range(seed):
    one_line_error(run("generate", "-p", "Once", "-n", "2", "--temp", "1", "--seed", seed), "--seed must be")
    one_line_error(run("bench", "--kv", "full", "--context", "8", "--gen", "2", "--repeats", "1", "--no-baseline",
                       "--seed", seed), "--seed must be")


def test_a_large_seed_runs():
    assert run("generate", "-p", "Once", "-n", "2", "--temp", "1", "--seed", 2**63 - 1).exit_code == 0


def test_a_bogus_kv_budget_is_refused_for_one_prompt_too():
    one_line_error(run("generate", "-p", "Once", "-n", "2", "--max-kv-bytes", "bogus"), "--max-kv-bytes")


# -- settings files ----------------------------------------------------------------------------------
def test_deeply_nested_files_are_named(tmp_path, default_model_dir):
    kv_config, profile, prompts = tmp_path / "kv.json", tmp_path / "p.toml", tmp_path / "rows.jsonl"
    kv_config.write_text("[" * DEEP + "]" * DEEP)
    profile.write_text("[kv]\nbits = " + "[" * DEEP + "]" * DEEP + "\n")
    prompts.write_text('{"prompt": ' + "[" * DEEP + "]" * DEEP + "}\n")
    model = tmp_path / "model"
    shutil.copytree(default_model_dir, model)
    (model / "config.json").write_text("{\"a\": " + "[" * DEEP + "]" * DEEP + "}")
    one_line_error(run("generate", "-p", "x", "-n", "2", "--kv-config", kv_config), "nested too deeply")
    one_line_error(run("generate", "-p", "x", "-n", "2", "--profile", profile), "nested too deeply")
    one_line_error(run("generate", "--prompts-file", prompts, "-n", "2"), "line 1: nested too deeply")
    one_line_error(run("generate", "-m", model, "-p", "x", "-n", "2"), "config.json is nested too deeply")


@pytest.mark.parametrize("body,message", [
    ("[kv]\nbits = 0\n", "'kv.bits' must be >= 1, got 0"),
    ("[kv]\ncodec = \"affine\"\n", "codec 'affine' needs bits"),
    ("[kv]\nkeep = -3\nwindow = 32\n", "'kv.keep' must be >= 0"),
], ids=["bits 0", "codec without bits", "negative keep"])
def test_profiles_that_would_silently_run_full_precision(tmp_path, body, message):
    profile = tmp_path / "p.toml"
    profile.write_text(body)
    one_line_error(run("generate", "-p", "x", "-n", "2", "--profile", profile), message)


# -- model folders -----------------------------------------------------------------------------------
def _edit(config: dict, change: str):
    if change == "list":
        return [1, 2]
    key, _, value = change.partition("=")
    if value == "DEL":
        del config[key]
    else:
        config[key] = json.loads(value)
    return config


@pytest.mark.parametrize("change,message", [
    ("num_hidden_layers=0", "'num_hidden_layers' must be a positive integer, got 0"),
    ("num_attention_heads=0", "'num_attention_heads' must be a positive integer, got 0"),
    ("num_key_value_heads=0", "'num_key_value_heads' must be a positive integer, got 0"),
    ("num_key_value_heads=3", "not a multiple of num_key_value_heads 3"),
    ("quantization=\"bogus\"", "'quantization' must be an object"),
    ("quantization={\"bits\": 7, \"group_size\": 64}", "affine bits 7 / group_size 64"),
    ("quantization={\"bits\": 4, \"group_size\": 64}", "the weights hold no quantized layer"),
    ("model_type=DEL", "'model_type' must be a non-empty string"),
    ("list", "config.json must be a JSON object"),
])
def test_bad_model_folders(tmp_path, default_model_dir, change, message):
    model = tmp_path / "model"
    shutil.copytree(default_model_dir, model)
    path = model / "config.json"
    path.write_text(json.dumps(_edit(json.loads(path.read_text()), change)))
    one_line_error(run("generate", "-m", model, "-p", "Once", "-n", "2"), message)


@pytest.mark.parametrize("name,content,message", [
    ("model.safetensors", b"garbage", "cannot load model"),
    ("tokenizer.json", b"garbage", "cannot load model"),
    ("config.json", b"\xff\xfe{}", "config.json is not UTF-8 text"),
])
def test_damaged_model_files(tmp_path, default_model_dir, name, content, message):
    model = tmp_path / "model"
    shutil.copytree(default_model_dir, model)
    (model / name).write_bytes(content)
    r = run("generate", "-m", model, "-p", "Once", "-n", "2")
    one_line_error(r, message)
    assert str(model) in r.stderr


# -- --prompts-file at scale ---------------------------------------------------------------------------
def test_prompts_file_validation_is_linear(tmp_path):
    """100 000 rows: the duplicate-id check used to count every id (100 000 lines took 220 s)."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(f'{{"prompt": "p{i}", "max_tokens": 4}}\n' for i in range(100_000)))
    done = {}
    t = threading.Thread(target=lambda: done.setdefault("specs", load_prompts_file(rows)), daemon=True)
    start = time.perf_counter()
    t.start()
    t.join(30)
    assert not t.is_alive(), "validating 100 000 rows took over 30 s (quadratic?)"
    assert len(done["specs"]) == 100_000 and time.perf_counter() - start < 30
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"prompt": "a", "id": 7}\n{"prompt": "b"}\n{"prompt": "c", "id": "7"}\n')
    one_line_error(cli("generate", "--prompts-file", dup, "-n", "2"), "id '7' appears more than once (lines 1 and 3)")


def test_a_byte_order_mark_does_not_turn_json_lines_into_text(tmp_path):
    rows = tmp_path / "bom.jsonl"
    rows.write_bytes(b'\xef\xbb\xbf{"prompt": "Once upon", "id": "a"}\n')
    assert [(s.prompt, s.id) for s in load_prompts_file(rows)] == [("Once upon", "a")]


@pytest.mark.parametrize("args,message", [
    (("generate", "-p", "x", "-n", "2", "--max-kv-size", 10**20), "--max-kv-size 100000000000000000000 is beyond"),
    (("generate", "-p", "x", "-n", "2", "--kv-bits", "4", "--quantized-kv-start", 10**20), "is beyond any context"),
    (("bench", "--kv", "full", "--context", 10**20, "--gen", "2", "--repeats", "1", "--no-baseline"),
     "--context 100000000000000000000 is beyond"),
])
def test_token_counts_past_any_context(args, message):
    one_line_error(run(*args), message)


@pytest.mark.skipif(not Path("/proc/self/mem").exists(), reason="needs Linux's /proc")
@pytest.mark.parametrize("flag", ["--prompt-file", "--prompts-file", "--kv-config", "--profile"])
def test_a_file_that_fails_to_read_is_named(flag):
    """/proc/self/mem is a regular file whose read fails (EIO): the error names the file."""
    args = ("generate", flag, "/proc/self/mem", "-n", "2") + (("-p", "x") if flag in ("--kv-config", "--profile") else ())
    one_line_error(run(*args), "/proc/self/mem: cannot read it (Input/output error)")
