"""Helpers for the KV persistence tests: runs through `run_generate`, references, file surgery."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from typer.testing import CliRunner

from kvcore.policy import KVOptions
from kvcore.jobs.generate import GenerateJob, run_generate
from mlxkv_cli.convert_kv import convert_kv
from mlxkv_cli.inspect_cache import inspect_cache
from mlxkv_cli.main import build_app

DOC = "Once upon a time there was a little girl. She liked to play with her big red ball in the park."
MORE = " One day she saw a big dog"


def job(prompt: str, model: str | None, n: int, kv: KVOptions = KVOptions(), **kw):
    """(RunResult, notices) of one `generate` run."""
    notices: list[str] = []
    r = run_generate(GenerateJob([prompt], model=model, max_tokens=n, kv=kv, **kw), on_notice=notices.append)
    return r, notices


def cli_app():
    """The CLI with the persistence commands, whether or not main.py registers them yet."""
    app = build_app()
    names = {c.name for c in app.registered_commands}
    if "convert-kv" not in names:
        app.command("convert-kv")(convert_kv)
    if "inspect-cache" not in names:
        app.command("inspect-cache")(inspect_cache)
    return app


def cli(*args):
    return CliRunner().invoke(cli_app(), [str(a) for a in args])


# -- safetensors surgery -----------------------------------------------------------------------
def split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def join(header: dict, data: bytes) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


def edit_doc(path: Path, out: Path, change) -> None:
    """Rewrite `path` to `out` with change(doc) applied to the mlxkv JSON document."""
    header, data = split(path)
    doc = json.loads(header["__metadata__"]["mlxkv"])
    change(doc)
    set_doc(header, json.dumps(doc))
    out.write_bytes(join(header, data))


def set_doc(header: dict, text: str) -> None:
    """Put `text` as the mlxkv document, with its checksum recomputed (a deliberate edit, not damage)."""
    header["__metadata__"]["mlxkv"] = text
    header["__metadata__"]["mlxkv_sha256"] = hashlib.sha256(text.encode()).hexdigest()
