"""`mlxkv fit`: what fits in a memory budget, per KV scheme, from config shapes alone."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer
from rich.table import Table

from kvcore.bench import SHAPES
from kvcore.bench.shapes import shape_weight_bytes
from kvcore.bench.fit import fit_table, weight_bytes_from_files
from kvcore.bench.grid import scheme_policy
from kvcore.errors import MlxkvError
from kvcore.models import resolve_model_path
from kvcore.units import format_bytes, parse_bytes

from .bench import parse_ints
from .bench_output import out
from .options import JsonOpt, KvConfigOpt, ModelOpt


def fit(
    memory: Annotated[str, typer.Option(help="Memory budget, e.g. 24GB.")],
    model: ModelOpt = None,
    shape: Annotated[Optional[str], typer.Option(help="A named shape instead of a model folder.")] = None,
    weight_bits: Annotated[str, typer.Option(help="With --shape: full, 8 or 4.")] = "full",
    kv: Annotated[str, typer.Option(help="Comma-separated KV schemes, as generate's --kv takes them "
                                         "(full, affine:4/g32, turbo:k4v3, turbo:4/r16, config:FILE).")] = "full,affine:8,affine:4",
    kv_config: KvConfigOpt = None,
    batch: Annotated[str, typer.Option(help="Batch sizes to find the longest context for.")] = "1,4,16",
    context: Annotated[str, typer.Option(help="Contexts to find the largest batch for.")] = "8192,32768,131072",
    dtype_bytes: Annotated[int, typer.Option(help="Bytes per full-precision KV element (2 = bf16/fp16).")] = 2,
    json_out: JsonOpt = False,
):
    """Largest context per batch and largest batch per context, per KV scheme (no weights loaded)."""
    budget = parse_bytes(memory, "--memory")
    policies = {s.strip(): scheme_policy(s.strip()) for s in kv.split(",") if s.strip()}
    if kv_config:
        policies["kv_config"] = scheme_policy(f"config:{kv_config}")
    if not policies:
        raise MlxkvError("--kv: no schemes given (e.g. --kv full,affine:4,turbo:k4v3)")
    batches, contexts = parse_ints(batch, "--batch"), parse_ints(context, "--context")
    if shape:
        if shape not in SHAPES:
            raise MlxkvError(f"unknown shape {shape!r}")
        if weight_bits not in ("full", "8", "4"):
            raise MlxkvError(f"--weight-bits must be full, 8 or 4, got {weight_bits!r}")
        config = SHAPES[shape]
        weights = shape_weight_bytes(shape, None if weight_bits == "full" else int(weight_bits))
    else:
        path, _ = resolve_model_path(model)
        if path.is_file():
            raise MlxkvError("fit reads a model folder's config.json; convert a GGUF first (convert-model)")
        config = json.loads((path / "config.json").read_text())
        weights = weight_bytes_from_files(path)
    rows = fit_table(config, policies, budget, weights, batches, contexts, dtype_bytes)
    if json_out:
        print(json.dumps({"budget_bytes": budget, "weight_bytes": weights, "rows": [r.to_json() for r in rows]}))
        return
    t = Table(title=f"fit: budget {format_bytes(budget)}, weights {format_bytes(weights)}")
    for c in ("scheme", "batch", "max context", "context", "max batch"):
        t.add_column(c)
    for r in rows:
        t.add_row(r.scheme, str(r.batch or "-"), str(r.max_context if r.max_context is not None else "-"),
                  str(r.context or "-"), str(r.max_batch if r.max_batch is not None else "-"))
    out.print(t)
