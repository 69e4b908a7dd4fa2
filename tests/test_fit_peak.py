"""`fit`'s predicted one-row peak (weights + KV + one layer's prefill transient) against the peak a
real run measures, on this backend: a long prompt through generate_one under the memory bound
the jobs use (kvcore.transient.PrefillMemory)."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx_lm import load

from kvcore.backend import backend_name
from kvcore.bench.fit import fit_table
from kvcore.engine import GenerateConfig, Request
from kvcore.engine.generate import generate_one
from kvcore.engine.memory import model_bytes
from kvcore.policy import KVOptions, build_caches, resolve_policy
from kvcore.transient import PrefillMemory

CONTEXT = 4096
SCHEMES = {"full": KVOptions(), "affine4": KVOptions(kv_bits=4, kv_group_size=32, quantized_kv_start=0)}


def measured_peak(path, opts: KVOptions, scheme: str, context: int) -> tuple[int, object]:
    """(measured peak bytes, fit's row) of a `context`-token prompt through generate_one under the jobs'
    memory bound, for the model folder at `path` (scripts/gpu_fit_peak_probe.py calls it too)."""
    model, tok = load(str(path))
    config = json.loads((path / "config.json").read_text())
    policy = resolve_policy(opts)
    weights = model_bytes(model)
    row = next(r for r in fit_table(config, {scheme: policy}, 8 << 30, weights, [], [context], dtype_size=4)
               if r.context == context)
    prompt = tuple((7 * i + 3) % (config["vocab_size"] - 4) + 3 for i in range(context - 1))
    mx.synchronize()
    mx.clear_cache()
    live = mx.get_active_memory()  # the weights, and whatever else the process holds
    mx.reset_peak_memory()
    caches = build_caches(model, policy)[0]
    generate_one(model, tok, Request(prompt, 1, "r"), caches,
                 GenerateConfig(prefill_chunk=row.chunk, prefill_memory=PrefillMemory(model, config, policy)))
    mx.synchronize()
    return mx.get_peak_memory() - live + weights, row


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("family", ["qwen3", "llama"])  # head_dim 64 (per-token affine) and 16 (token-grouped)
def test_fit_predicts_the_measured_peak(tiny_models, family, scheme, request):
    if backend_name() == "cuda" and family == "llama":
        # MLX's CUDA backend runs this head-dim-16 float32 prefill with more than the one score matrix the
        # model counts (H200: 1.97x fit's peak for full, 1.09-1.31x for affine:4, scripts/gpu_fit_peak_probe.py);
        # qwen3's head dim 64 lands within the bound. strict: the day fit counts it, this says so
        request.applymarker(pytest.mark.xfail(strict=True, reason="fit under-counts CUDA's unfused SDPA at head dim 16"))
    measured, row = measured_peak(tiny_models(family), SCHEMES[scheme], scheme, CONTEXT)
    ratio = measured / row.peak
    # an upper bound (never under by more than a little) and close to it: full precision lands within
    # 1%; compressed rows about 11% under it, since the plan sums parts that are not all live at once
    # (the decode workspace is freed before the scores exist; CPU run-ahead is held back by the bound)
    # CUDA: 1.02-1.04x for qwen3 full on the H200 (gpu_fit_peak_probe.py; the extra is not yet named)
    assert 0.85 <= ratio <= (1.05 if backend_name() == "cuda" else 1.03), (measured, row.peak)
    if scheme == "full":
        assert ratio >= 0.97
