"""Helpers for the multi-rank tests: run a shell line on 2 local ranks (ring backend), or the CLI once
in this process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from mlxkv_cli.main import build_app

LAUNCH = shutil.which("mlx.launch", path=os.path.dirname(sys.executable)) or shutil.which("mlx.launch")
MLXKV = shutil.which("mlxkv", path=os.path.dirname(sys.executable)) or shutil.which("mlxkv")
needs_launch = pytest.mark.skipif(not LAUNCH or not MLXKV, reason="mlx.launch / mlxkv not on PATH")
ENV = {**os.environ, "MLXKV_DIST_TIMEOUT": "30", "PYTHONUNBUFFERED": "1"}
QUIET_LAUNCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mlx_launch_quiet.py")  # mlx.launch, no spin


def launch(cmd: str, port: int, timeout: int = 120, env: dict | None = None):
    """Run `cmd` (a shell line; $MLX_RANK is set) on 2 local ranks."""
    return subprocess.run([sys.executable, QUIET_LAUNCH, "-n", "2", "--backend", "ring", "--starting-port", str(port), "--",
                           "sh", "-c", cmd], capture_output=True, text=True, timeout=timeout,
                          env={**ENV, **(env or {})}, cwd="/tmp")


def single(args: list[str]) -> subprocess.CompletedProcess:
    """The CLI run once by one process (this one, through CliRunner: no interpreter start)."""
    r = CliRunner().invoke(build_app(), args)
    return subprocess.CompletedProcess(args, r.exit_code, r.stdout, r.stderr)


def tokens(stdout: str) -> list[list[int]]:
    return [o["token_ids"] for o in map(json.loads, stdout.splitlines()) if o["type"] == "completion"]
