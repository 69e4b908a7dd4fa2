"""Shared pytest fixtures.

Add new fixtures in their own clearly-marked section below; keep this file
free of test logic.  Builders live in ``tests/fixtures/`` (importable as
``fixtures.<module>`` because pytest puts this directory on ``sys.path``).
"""

from __future__ import annotations

import os

os.environ.setdefault("MLX_ENABLE_TF32", "0")  # exact float32 matmuls on CUDA (TF32 is MLX's default there)

from pathlib import Path
from typing import Callable, Dict

import pytest

from fixtures.tiny_models import FAMILIES, build_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[1]


# --- models -----------------------------------------------------------------


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The embedded stories260K llama model (real weights, vocab 512)."""
    return REPO_ROOT / "kvcore/assets/stories260K"


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Callable[[str], Path]:
    """``get(family) -> Path``: a tiny random-weight model folder per family.

    Families: ``fixtures.tiny_models.FAMILIES``.  Each is built lazily, once
    per session, and loads with ``mlx_lm.load(str(path))``.
    """
    root = tmp_path_factory.mktemp("tiny_models")
    built: Dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in FAMILIES:
            raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
        if family not in built:
            built[family] = build_tiny_model(family, root / family)
        return built[family]

    return get


@pytest.fixture(scope="session")
def dense_gguf(tmp_path_factory) -> Path:
    """stories260K written as a float32 GGUF file (tests/gguf_helpers.py)."""
    from gguf_helpers import write_dense

    return write_dense(tmp_path_factory.mktemp("gguf") / "stories260K-f32.gguf")


# --- bench ------------------------------------------------------------------


@pytest.fixture(scope="session")
def stories_bench(tmp_path_factory):
    """``(report, stderr, png)`` of one ``mlxkv bench --json`` on the embedded model: full and affine:4
    at contexts 16 and 32, 3 tokens, one repeat (mlx-lm cannot quantize its head_dim 8), plotted to
    ``png`` where matplotlib is installed (else None).  One run shared by the bench tests."""
    import importlib.util
    import json

    from typer.testing import CliRunner

    from mlxkv_cli.main import build_app

    args = ["bench", "--kv", "full,affine:4", "--context", "16,32", "--gen", "3", "--repeats", "1", "--json"]
    png = tmp_path_factory.mktemp("bench") / "p.png" if importlib.util.find_spec("matplotlib") else None
    r = CliRunner().invoke(build_app(), args + (["--plot", str(png)] if png else []))
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout), r.stderr, png


QWEN3_BENCH_SCHEMES = ("full", "affine:8", "affine:4", "turbo:k4v3", "turbo:4/r8", "affine:4/g32/r3")


@pytest.fixture(scope="session")
def qwen3_bench(tiny_models, tmp_path_factory):
    """``(report, folder)`` of one ``mlxkv bench --json`` on the qwen3 fixture (head_dim 64: mlx-lm
    quantizes one row, codec arithmetic is exact): ``QWEN3_BENCH_SCHEMES`` at context 64, batches 1
    and 2, 4 tokens, one repeat, also written to ``folder``/b.csv and b.json.  Shared by test_bench
    and test_bench_codecs (one run, one bandwidth probe)."""
    import json

    from typer.testing import CliRunner

    from mlxkv_cli.main import build_app

    out = tmp_path_factory.mktemp("qwen3_bench")
    r = CliRunner().invoke(build_app(), [
        "bench", "-m", str(tiny_models("qwen3")), "--kv", ",".join(QWEN3_BENCH_SCHEMES), "--context", "64",
        "--batch", "1,2", "--gen", "4", "--repeats", "1", "--json", "--csv", str(out / "b.csv"),
        "--output", str(out / "b.json")])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout), out
