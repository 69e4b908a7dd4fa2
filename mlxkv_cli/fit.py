"""`mlxkv fit`: what fits in a memory budget, per KV scheme, from config shapes alone."""

from __future__ import annotations

import json
import re
from typing import Annotated, Optional

import typer
from rich.table import Table

from kvcore.bench import SHAPES, shape_names
from kvcore.bench.shapes import shape_weight_bytes
from kvcore.errors import MlxkvError
from kvcore.model_shape import SIZES, check_layers, model_shape
from kvcore.models import dtype_name, parse_dtype
from kvcore.policy.kv_spec import split_kv_list
from kvcore.units import format_bytes, parse_bytes

from .bench import parse_ints
from .bench_output import out
from .hub import fetch_model
from .options import DtypeOpt, JsonOpt, KvConfigOpt, ModelOpt, OfflineOpt


def fit(
    memory: Annotated[str, typer.Option(help="Memory budget with a unit: 24GB, 24GiB, 512MB (a bare number is refused).")],
    model: ModelOpt = None,
    shape: Annotated[Optional[str], typer.Option(help="A named shape instead of a model (llama-8b, qwen3-4b, ...).")] = None,
    weight_bits: Annotated[Optional[str], typer.Option(help="With --shape: full, 8 or 4 (default full).")] = None,
    kv: Annotated[str, typer.Option(help="Comma-separated KV schemes, as generate's --kv takes them "
                                         "(full, affine:4/g32, turbo:k4v3, turbo:4/r16, config:FILE).")] = "full,affine:8,affine:4",
    kv_config: KvConfigOpt = None,
    batch: Annotated[str, typer.Option(help="Batch sizes to find the longest context for.")] = "1,4,16",
    context: Annotated[str, typer.Option(help="Contexts to find the largest batch for.")] = "8192,32768,131072",
    dtype: DtypeOpt = None,
    dtype_bytes: Annotated[Optional[int], typer.Option(help="Bytes per full-precision KV element instead of a dtype's (default: the dtype the run uses: the model's, or --dtype; bfloat16 for a --shape).")] = None,
    offline: OfflineOpt = False,
    json_out: JsonOpt = False,
):
    """Largest context per batch and largest batch per context, per KV scheme (no weights loaded)."""
    from kvcore.bench.fit import fit_table
    from kvcore.bench.grid import scheme_policy
    budget = read_budget(memory)
    policies = {s: scheme_policy(s) for s in split_kv_list(kv)}
    if kv_config:
        policies["kv_config"] = scheme_policy(f"config:{kv_config}")
    if not policies:
        raise MlxkvError("--kv: no schemes given (e.g. --kv full,affine:4,turbo:k4v3)")
    batches, contexts = parse_ints(batch, "--batch"), parse_ints(context, "--context")
    dtype = dtype_name(dtype)
    if dtype_bytes is not None and (dtype_bytes < 1 or dtype_bytes > 8):
        raise MlxkvError(f"--dtype-bytes must be 1..8 bytes per KV element, got {dtype_bytes}")
    if dtype_bytes is not None and dtype is not None:
        raise MlxkvError("give --dtype or --dtype-bytes, not both")
    if shape and model:
        raise MlxkvError("give either -m/--model or --shape, not both")
    if weight_bits is not None and not shape:
        raise MlxkvError("--weight-bits sets the random weights of a --shape: give --shape (a model's weights are "
                         "what its files hold)")
    if shape:
        if shape not in SHAPES:
            raise MlxkvError(f"unknown shape {shape!r} (known: {', '.join(shape_names())})")
        bits = weight_bits or "full"
        if bits not in ("full", "8", "4"):
            raise MlxkvError(f"--weight-bits must be full, 8 or 4, got {bits!r}")
        config, kv_dtype, why = SHAPES[shape], dtype or "bfloat16", "bench's dtype for shapes" if not dtype else "--dtype"
        weights = shape_weight_bytes(shape, None if bits == "full" else int(bits), parse_dtype(kv_dtype))
    else:
        fetch_model(model, offline)
        m = model_shape(model)
        config, weights = m.config, m.weight_bytes
        kv_dtype, why = (dtype, "--dtype") if dtype else (m.kv_dtype, "the model's dtype")
    for p in policies.values():
        check_layers(config, p)
    size = dtype_bytes or SIZES[kv_dtype]
    kv_note = f"{dtype_bytes} bytes (--dtype-bytes)" if dtype_bytes else f"{kv_dtype}, {size} bytes ({why})"
    if budget <= weights:
        raise MlxkvError(f"--memory {memory.strip()} ({format_bytes(budget)}) does not hold the weights alone "
                         f"({format_bytes(weights)}): nothing fits; give a larger budget")
    rows = fit_table(config, policies, budget, weights, batches, contexts, size)
    if json_out:
        print(json.dumps({"budget_bytes": budget, "weight_bytes": weights, "kv_dtype": None if dtype_bytes else kv_dtype,
                          "kv_dtype_bytes": size, "rows": [r.to_json() for r in rows]}))
        return
    t = Table(title=f"fit: budget {format_bytes(budget)}, weights {format_bytes(weights)}, "
                    f"full-precision KV in {kv_note}")
    for c in ("scheme", "batch", "max context", "context", "max batch", "1-row peak", "prefill chunk"):
        t.add_column(c)
    for r in rows:
        peak = "-" if r.context is None else (format_bytes(r.peak) if r.peak is not None else "does not fit")
        t.add_row(r.scheme, str(r.batch or "-"), str(r.max_context if r.max_context is not None else "-"),
                  str(r.context or "-"), str(r.max_batch if r.max_batch is not None else "-"), peak,
                  str(r.chunk) if r.chunk else "-")
    out.print(t)
    out.print("peak: weights + one row's KV + one layer's prefill transient (the chunk the budget allows, "
              "as generate runs it)")


def read_budget(text: str) -> int:
    """--memory: a size with a unit (24GB, 24GiB, 512MB), more than 0."""
    if re.fullmatch(r"\s*[0-9.]+\s*", text):
        raise MlxkvError(f"--memory {text.strip()}: give a unit, e.g. {text.strip()}GB or {text.strip()}GiB "
                         f"(a bare number would be read as bytes)")
    budget = parse_bytes(text, "--memory")
    if budget <= 0:
        raise MlxkvError(f"--memory must be more than 0, got {text.strip()!r}")
    return budget
