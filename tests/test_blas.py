"""kvcore.blas: which BLAS backs MLX's CPU matmuls, in this process and in subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from kvcore.blas import BlasStatus, blas_status, openblas_candidates

ROOT = Path(__file__).resolve().parents[1]
LINUX = sys.platform.startswith("linux")
OPENBLAS = next((p for p in openblas_candidates() if os.path.exists(p) and "libblas" in p), None)
needs_openblas = pytest.mark.skipif(
    not (LINUX and OPENBLAS), reason="Debian OpenBLAS not installed (libopenblas0-pthread)")
cpu_backend = pytest.mark.skipif(mx.default_device() != mx.cpu,
                                 reason="GPU default device: the CPU BLAS does not serve MLX's matmuls")

# kvcore/blas.py on its own (kvcore's package imports mlx-lm: 2 s a probe): blas_status of a fresh process
PROBE = ("import importlib.util, json, sys, mlx.core as mx; "
         f"spec = importlib.util.spec_from_file_location('kvcore_blas', {str(ROOT / 'kvcore' / 'blas.py')!r}); "
         "blas = sys.modules['kvcore_blas'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(blas); "
         "s = blas.blas_status(); "
         "print(json.dumps({'optimized': s.optimized, 'library': s.library, 'hint': s.hint, "
         "'cpu': mx.default_device() == mx.cpu}))")


def probe(env_update: dict[str, str | None], shell_prefix: str = "") -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "OPENBLAS_CORETYPE")}
    env.update({k: v for k, v in env_update.items() if v is not None})
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    cmd = [sys.executable, "-c", PROBE]
    if shell_prefix:
        cmd = ["bash", "-c", f'{shell_prefix} && exec "$0" -c "$1"', sys.executable, PROBE]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_status_is_consistent():
    s = blas_status()
    assert isinstance(s, BlasStatus)
    assert blas_status() is s  # cached
    if not s.optimized:
        assert s.hint and "LD_PRELOAD" in s.hint and "\n" not in s.hint
    if LINUX:
        assert s.library  # something provides sgemm_ for libmlx


@pytest.mark.skipif(not LINUX, reason="Linux CPU only")
def test_without_preload_reports_reference_blas():
    s = probe({})
    if not s["cpu"]:
        pytest.skip("GPU default device")
    if s["optimized"]:
        pytest.skip(f"this mlx build links an optimized BLAS: {s['library']}")
    assert "reference" in s["library"] and "LD_PRELOAD" in s["hint"]


@needs_openblas
@cpu_backend
def test_preloaded_openblas_is_detected():
    s = probe({"LD_PRELOAD": OPENBLAS})
    assert s["optimized"] and "OpenBLAS" in s["library"], s


@needs_openblas
@cpu_backend
def test_blas_env_script():
    s = probe({}, shell_prefix=f'. "{ROOT}/scripts/blas-env.sh"')
    assert s["optimized"] and "OpenBLAS" in s["library"], s
    assert s["hint"] is None, s  # and OPENBLAS_CORETYPE fixed where needed


def test_blas_env_script_is_noop_without_openblas(tmp_path):
    # A machine without OpenBLAS: fake `uname -m` so no candidate path exists.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "uname").write_text("#!/bin/sh\necho nosucharch\n")
    (fake / "uname").chmod(0o755)
    out = subprocess.run(
        ["bash", "-c", f'. "{ROOT}/scripts/blas-env.sh"; echo "[${{LD_PRELOAD:-}}]"'],
        capture_output=True, text=True, timeout=30,
        env={"PATH": f"{fake}:{os.environ['PATH']}"})
    assert out.returncode == 0 and out.stdout.strip() == "[]", out
