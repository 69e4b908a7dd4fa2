#!/usr/bin/env python3
"""Where a 4-bit-weight model's prefill spends memory the plan does not name (issue 14, P8): run 12 measured
~0.9-1.0 GB more than the memory model's transient at both 32k and 128k (`--weight-bits 4`, 10 GiB budget),
a constant, so not the KV or the attention scratch. Each of the model's quantized matmuls (one layer's
projections, the embedding, the output head) is run alone on M rows, M = 1 (a decode step, the prompt's last
position) and the prefill chunk, and its peak above the memory already held is printed next to its output's
size: a matmul whose peak is its weight in bf16 dequantizes the whole matrix first.

    python scripts/gpu_qmm_transient.py [--shape llama-8b] [--rows 1,2048]
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
import mlx.nn as nn

from kvcore.bench.shapes import build_random_model


def named_quantized(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The first layer's quantized modules, and every quantized module outside the layers."""
    out = []
    for name, m in model.named_modules():
        if not isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            continue
        if ".layers." in f".{name}." and ".layers.0." not in f".{name}.":
            continue
        out.append((name, m))
    return out


def peak_of(fn) -> tuple[int, int]:
    mx.synchronize()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    y = fn()
    mx.eval(y)
    mx.synchronize()
    extra = mx.get_peak_memory() - base
    return extra, y.nbytes


def report(name: str, rows: int, call, dense: int) -> None:
    extra, out = peak_of(call)
    print(json.dumps({"module": name, "rows": rows, "peak_above_held_mb": round(extra / 1e6, 3),
                      "output_mb": round(out / 1e6, 3), "weight_bf16_mb": round(dense / 1e6, 3),
                      "dequantizes": extra - out > 0.5 * dense}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-8b")
    ap.add_argument("--rows", default="1,2048")
    a = ap.parse_args()
    model, cfg = build_random_model(a.shape, weight_bits=4)
    cfg = cfg.get("text_config", cfg)
    for name, m in named_quantized(model):
        for rows in (int(r) for r in a.rows.split(",")):
            if isinstance(m, nn.QuantizedEmbedding):
                ids = mx.random.randint(0, cfg["vocab_size"], (1, rows))
                mx.eval(ids)
                call = lambda m=m, ids=ids: m(ids)  # noqa: E731
                dense = m.weight.shape[0] * m.weight.shape[1] * 32 // m.bits * 2
            else:
                x = mx.random.normal((1, rows, m.weight.shape[1] * 32 // m.bits)).astype(mx.bfloat16)
                mx.eval(x)
                call = lambda m=m, x=x: m(x)  # noqa: E731
                dense = m.weight.shape[0] * m.weight.shape[1] * 32 // m.bits * 2
            report(name, rows, call, dense)
            if isinstance(m, nn.QuantizedEmbedding) and getattr(cfg, "get", dict().get)("tie_word_embeddings", False):
                x = mx.random.normal((1, rows, m.weight.shape[1] * 32 // m.bits)).astype(mx.bfloat16)
                mx.eval(x)
                report(name + ".as_linear", rows, lambda m=m, x=x: m.as_linear(x), dense)  # the tied output head


if __name__ == "__main__":
    main()
