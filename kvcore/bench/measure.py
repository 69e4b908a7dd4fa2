"""Measure one bench case: mlxkv's engine, and mlx-lm on the same model and prompts.

Per case: prefill tok/s, time to first token, aggregate decode tok/s, peak memory, KV bytes,
bits per element, and the bytes a decode step must read (weights + KV) with the bandwidth
that implies (as gpt-fast reports it).
"""

from __future__ import annotations

import importlib
import time

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..backend import failure
from ..engine import GenerateConfig, Request
from ..engine import Engine
from ..policy import KVPolicy


def seeded_prompts(vocab: int, batch: int, context: int, seed: int = 0) -> list[list[int]]:
    key = mx.random.key(seed)
    toks = mx.random.randint(3, vocab, (batch, context), key=key)
    return toks.tolist()


def weight_bytes(model: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def _nbytes(module: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def step_weight_bytes(model: nn.Module) -> int:
    """Weight bytes one decode step reads: every weight but embedding tables, which are only
    gathered (a row per token), except the token embedding when the output layer is tied to it."""
    mods = dict(model.named_modules())
    tables = {k: m for k, m in mods.items() if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding))}
    tied = not any(k == "lm_head" or k.endswith(".lm_head") for k in mods)
    skipped = sum(_nbytes(m) for k, m in tables.items() if not (tied and k.endswith("embed_tokens")))
    return weight_bytes(model) - skipped


def measure_mlxkv(model, policy: KVPolicy, prompts: list[list[int]], gen: int, prefill_chunk: int = 2048) -> dict:
    reqs = [Request(tuple(p), gen, str(i)) for i, p in enumerate(prompts)]
    engine = Engine(model, None, policy, len(prompts), GenerateConfig(prefill_chunk=prefill_chunk),
                    interleave=False)
    mx.synchronize()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    out = engine.run(reqs)
    mx.synchronize()
    wall = time.perf_counter() - t0
    prefill = sum(c.prompt_time for c in out)
    decode_time, steps = engine.decode_time, sum(1 for t in engine.trace if t[0] == "decode")
    kv = engine.peak_kv
    return {
        "prefill_tps": sum(len(p) for p in prompts) / prefill, "ttft_s": out[0].prompt_time,
        "decode_tps": engine.decoded / decode_time if decode_time else 0.0,
        "decode_tps_per_row": steps / decode_time if decode_time else 0.0,
        "peak_memory_gb": mx.get_peak_memory() / 1e9, "kv_bytes": kv.get("kv_bytes"),
        "bits_per_element": kv.get("bits_per_element"), "wall_s": wall, "attention_path": engine.attention_stats.path,
        "tokens": sum(len(c.token_ids) for c in out), "decode_steps": steps,
    }


def measure_mlx_lm(model, kv_bits: int | None, group: int, prompts: list[list[int]], gen: int,
                   prefill_chunk: int = 2048) -> dict:
    """mlx-lm's own generate_step (one row) or BatchGenerator (rows, full-precision KV only)."""
    g = importlib.import_module("mlx_lm.generate")
    mx.synchronize()
    mx.reset_peak_memory()
    if len(prompts) > 1 and kv_bits:
        return {"error": "not supported: mlx-lm's BatchGenerator cannot quantize the KV cache"}
    try:
        t0 = time.perf_counter()
        if len(prompts) == 1:
            kw = {"kv_bits": kv_bits, "kv_group_size": group, "quantized_kv_start": 0} if kv_bits else {}
            it = g.generate_step(mx.array(prompts[0]), model, max_tokens=gen, prefill_step_size=prefill_chunk, **kw)
            next(it)
            t1 = time.perf_counter()
            n = sum(1 for _ in it)
            tokens = n + 1
        else:
            bg = g.BatchGenerator(model, stop_tokens=[], completion_batch_size=len(prompts),
                                  prefill_batch_size=len(prompts), prefill_step_size=prefill_chunk)
            bg.insert(prompts, [gen] * len(prompts))
            bg.next_generated()  # every row's first token: prefill done
            t1 = time.perf_counter()
            n = 0
            while responses := bg.next_generated():
                n += len(responses)
            bg.close()
            tokens = n + len(prompts)
        mx.synchronize()
        t2 = time.perf_counter()
    except Exception as e:  # the baseline's failure is a result: shown, never hidden
        return {"error": failure(e)}
    return {"prefill_tps": sum(len(p) for p in prompts) / (t1 - t0), "ttft_s": t1 - t0,
            "decode_tps": n / (t2 - t1), "decode_tps_per_row": n / len(prompts) / (t2 - t1),
            "peak_memory_gb": mx.get_peak_memory() / 1e9, "tokens": tokens}
