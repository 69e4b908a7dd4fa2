"""The mlxkv command uses an installed OpenBLAS by default (re-exec with it preloaded, before mlx is
imported), opts out with MLXKV_NO_OPENBLAS=1, and without one says in one line what it would gain.
Each case runs the real entry point in a subprocess (LD_PRELOAD only acts when a process starts)."""

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from kvcore.blas import openblas_candidates
from mlxkv_cli.blas_preload import HINT, REEXEC, candidates, find_openblas, preload_env

ROOT = Path(__file__).resolve().parents[1]
LINUX = sys.platform.startswith("linux")
INSTALLED = find_openblas({}) if LINUX else None


def version(**env_update) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "OPENBLAS_CORETYPE", REEXEC,
                                                           "MLXKV_NO_OPENBLAS", "MLXKV_OPENBLAS")}
    env.update(env_update)
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return subprocess.run([sys.executable, "-m", "mlxkv_cli", "--version"], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)


def blas_line(r) -> str:
    assert r.returncode == 0, r.stderr
    return next((x for x in r.stdout.splitlines() if x.startswith("cpu blas: ")), "")


@pytest.mark.skipif(not (LINUX and INSTALLED), reason="no OpenBLAS installed (libopenblas0-pthread)")
@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="GPU default device: --version names no CPU BLAS")
def test_installed_openblas_is_used_without_any_setup():
    r = version()
    assert "OpenBLAS" in blas_line(r) and HINT not in r.stderr
    off = version(MLXKV_NO_OPENBLAS="1")
    assert "reference BLAS" in blas_line(off) and HINT not in off.stderr  # opted out: nothing said either


@pytest.mark.skipif(not LINUX, reason="Linux only")
def test_without_openblas_one_line_says_what_installing_it_gains():
    r = version(MLXKV_OPENBLAS="/nonexistent/libopenblas.so.0")  # as if none were installed
    line = blas_line(r)
    if not line:
        pytest.skip("GPU default device: the CPU BLAS does not matter")
    assert "reference BLAS" in line
    said = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(said) == 1 and HINT in said[0] and "apt-get install libopenblas0-pthread" in said[0]


def test_preload_env_is_applied_once():
    lib = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
    if not (LINUX and os.path.isfile(lib)):
        lib = INSTALLED
    if lib is None:
        assert preload_env({"MLXKV_OPENBLAS": "/nonexistent"}) is None
        return
    env = preload_env({"MLXKV_OPENBLAS": lib, "LD_PRELOAD": "/x/libother.so"})
    assert env["LD_PRELOAD"] == f"{lib}:/x/libother.so" and env[REEXEC] == "1"
    assert preload_env(env) is None  # the re-exec'd process does not exec again
    assert preload_env({"MLXKV_OPENBLAS": lib, "LD_PRELOAD": lib}) is None  # already preloaded
    assert preload_env({"MLXKV_OPENBLAS": lib, "MLXKV_NO_OPENBLAS": "1"}) is None


def test_one_list_of_openblas_paths():
    assert candidates() == openblas_candidates()
