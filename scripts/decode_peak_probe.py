#!/usr/bin/env python3
"""Peak memory of decode steps that grow every layer's buffer: one row filled to a whole number of 256-token steps
(as `gpu_bench.py` fills it), its one-token prompt, then decode steps past the next step boundary, with the engine's
runner growing the caches before the step (`kvcore/cache/room.py`, the default) or with that pass taken out
(`inside`: each cache grows inside the step's update). Prints the decode steps' peak above what is held after the
prompt. Random weights (the named shape's), any backend.

    python scripts/decode_peak_probe.py [before|inside] [--shape peak-probe] [--context 65536] [--kv affine:4]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import fill  # noqa: E402

from kvcore.bench.grid import scheme_policy  # noqa: E402
from kvcore.bench.shapes import SHAPES, build_random_model  # noqa: E402
from kvcore.engine import Engine, GenerateConfig, Request  # noqa: E402

# CPU-sized: 16 layers of 8 KV heads x 128 (about 20 KB of affine:4 K/V a token)
SHAPES.setdefault("peak-probe", {**SHAPES["llama-tiny"], "num_hidden_layers": 16, "num_key_value_heads": 8,
                                 "num_attention_heads": 8, "head_dim": 128, "hidden_size": 256})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("before", "inside"))
    ap.add_argument("--shape", default="peak-probe")
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--kv", default="affine:4")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--gen", type=int, default=300, help="decode steps (past the step boundary after the prompt)")
    a = ap.parse_args()
    dtype = getattr(mx, a.dtype)
    model, cfg = build_random_model(a.shape, dtype=dtype)
    cfg = cfg.get("text_config", cfg)
    mx.eval(model.parameters())
    if a.mode == "inside":  # the runner's pass taken out: each cache grows inside the step
        from kvcore.engine import runner
        from kvcore.engine.forward import forward

        runner.Runner.forward = lambda self, tokens: forward(self.model, tokens, self.caches)
    engine = Engine(model, None, scheme_policy(a.kv), 1, GenerateConfig(prefill_chunk=2048), interleave=False,
                    ignore_eos=True)
    heads, dim = cfg["num_key_value_heads"], cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    caches = fill(engine.runner.new_caches(), a.context, heads, dim, dtype)
    engine.runner.new_caches = lambda: caches
    engine.add_request(Request((11,), a.gen, "0"))
    engine.step()  # the prompt (its own growth: the prefill's)
    mx.synchronize()
    mx.clear_cache()
    held = mx.get_active_memory()
    mx.reset_peak_memory()
    while engine.has_work:
        engine.step()
    mx.synchronize()
    print(f"{a.mode} {a.kv} {a.context}: held {held / 1e6:.1f} MB, peak above held {(mx.get_peak_memory() - held) / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
