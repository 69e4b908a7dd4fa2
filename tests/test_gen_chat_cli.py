"""`mlxkv chat` driven through stdin: turns, /stats, /save, /reset, /load, Ctrl-C (issue 18)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlxkv_cli.main import build_app
from test_gen_chat import TEMPLATES

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def chat_model(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("chatcli") / "llama-chatml"
    shutil.copytree(tiny_models("llama"), out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATES["chatml"]
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(out)


def stats(stdout: str) -> list[dict]:
    rows = []
    for m in re.finditer(r"tokens (\d+) \| turns (\d+)(?: \| last turn: (\d+) prefilled, (\d+) reused)?", stdout):
        rows.append({"tokens": int(m[1]), "turns": int(m[2]), "prefilled": int(m[3] or 0), "reused": int(m[4] or 0)})
    return rows


def test_a_session_through_stdin(chat_model, tmp_path):
    f = tmp_path / "talk.kv"
    script = f"Hi\n/stats\nWho are you?\n/stats\n/save {f}\n/reset\n/stats\n/load {f}\n/stats\nAnd then?\n/stats\n/bogus\n/quit\n"
    r = CliRunner().invoke(build_app(), ["chat", "-m", chat_model, "-n", "4", "--kv", "affine:8/g32"], input=script)
    assert r.exit_code == 0, r.output
    s = stats(r.stdout)
    assert [x["turns"] for x in s] == [1, 2, 0, 0, 1]
    first, second, reset, loaded, third = s
    assert second["reused"] >= first["tokens"] - 1 and second["prefilled"] < first["tokens"]  # only the new turn
    assert reset["tokens"] == 0 and loaded["tokens"] == second["tokens"]
    assert third["reused"] >= loaded["tokens"] - 1  # the loaded cache carried the conversation on
    assert f.is_file() and Path(str(f) + ".chat.json").is_file()
    assert "unknown command /bogus" in r.stderr


def test_bad_input_keeps_the_session_or_is_one_line(chat_model, tmp_path):
    r = CliRunner().invoke(build_app(), ["chat", "-m", chat_model, "-n", "2"],
                           input=f"/load {tmp_path / 'missing.kv'}\n/save\nHi\n/stats\n")
    assert r.exit_code == 0 and stats(r.stdout)[0]["turns"] == 1, r.output
    assert r.stderr.count("error:") == 2
    r = CliRunner().invoke(build_app(), ["chat", "-n", "2"], input="Hi\n")  # the embedded model: no template
    assert r.exit_code == 1 and "no chat template" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_ctrl_c_stops_the_answer_not_the_session(chat_model):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}  # keeps where mlx is
    # Ctrl-C must reach the chat even where this suite runs with SIGINT ignored (a background job
    # without job control): Python leaves an ignored SIGINT ignored, so the child installs its handler itself
    entry = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
             "runpy.run_module('mlxkv_cli', run_name='__main__', alter_sys=True)")
    proc = subprocess.Popen([sys.executable, "-c", entry, "chat", "-m", chat_model, "-n", "20000"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    got = b""

    def send(text: bytes, until) -> None:
        nonlocal got
        proc.stdin.write(text)
        proc.stdin.flush()
        start = len(got)
        while not until(got[start:]):
            chunk = os.read(proc.stdout.fileno(), 256)
            assert chunk, f"chat ended early: {proc.stderr.read().decode()[-2000:]}"
            got += chunk

    try:
        for question in (b"Tell me a long story\n", b"/stats\nGo on\n"):
            send(question, lambda new: len(new.split(b"bits/element)\n")[-1]) >= 20)  # an answer streams
            proc.send_signal(signal.SIGINT)  # Ctrl-C
        out, err = proc.communicate(b"/stats\n", timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err.decode()[-2000:]
    s = stats((got + out).decode())
    assert [x["turns"] for x in s] == [1, 2] and s[1]["tokens"] < 20000, s
    assert s[1]["reused"] >= s[0]["tokens"] - 1  # the stopped answer stayed in the cache and the conversation
    assert err.decode().count("stopped (Ctrl-C)") == 2
