#!/usr/bin/env python3
"""Speculative decoding vs plain decoding in one run: acceptance and decode tok/s, per KV scheme,
for the target as its own draft (or --draft-model) and for prompt lookup; mlx-lm's
speculative_generate_step beside them (its kv_bits for the affine schemes, where mlx-lm can quantize).

    python scripts/bench_spec.py [-m MODEL] [--draft-model M] [--prompt-file F | --story-from CORPUS --task T]
                                 [--gen 200] [-k 4] [--repeats 3] [--schemes full,affine:8,affine:4]

Runs are interleaved (one warm-up round, then `repeats` rounds of every engine), medians reported.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import mlx.core as mx

from kvcore.backend import backend_name, versions
from kvcore.engine import GenerateConfig, Request
from kvcore.engine import Engine
from kvcore.engine.prompt import encode_prompt
from kvcore.models import load_model
from kvcore.policy import KVOptions, resolve_policy
from kvcore.speculative import ModelDraft, PromptLookup, SpecEngine

SCHEMES = {"full": KVOptions(), "affine:8": KVOptions(kv_bits=8, quantized_kv_start=0),
           "affine:4": KVOptions(kv_bits=4, quantized_kv_start=0)}
TASKS = {"summarise": "Summarise the story above, quoting its most important sentences word for word.",
         "retell": "Retell the story above. Keep its sentences exactly as they are."}
PROMPT = ("Lily and Tom went to the park. They played with the big red ball. Lily said, \"Tom, throw the ball!\" "
          "Tom threw the ball. Lily and Tom went to the park again the next day. They played with the big red ball.")


def story_prompt(corpus: str, task: str) -> str:
    """The corpus's first story of over 120 words, then the task's instruction."""
    story = next(s.strip() for s in open(corpus).read().split("\n\n") if len(s.split()) > 120)
    return f"Here is a story.\n\n{story}\n\n{TASKS[task]}"


def run_engine(make, lm, ids, gen, models=()):
    """(decode tok/s, engine) of one run, EOS ignored. Decode = the engine's decode steps or
    rounds only (prompt and draft prefill excluded)."""
    engine = make()
    engine.ignore_eos = True
    engine.run([Request(tuple(ids), gen, "0")])
    return engine.decoded / engine.decode_time, engine


def mlx_lm_runner(lm, draft, ids, gen, k, speculative, kv: KVOptions):
    """mlx-lm's own loop: (decode tok/s = whole run minus a 1-token run, tokens from the draft)."""
    from mlx_lm.generate import generate_step, speculative_generate_step

    quant = {"kv_bits": kv.kv_bits, "kv_group_size": 64, "quantized_kv_start": 0} if kv.kv_bits else {}

    def step(n):
        if speculative:
            return speculative_generate_step(mx.array(ids), lm.model, draft, num_draft_tokens=k, max_tokens=n,
                                             **quant)
        return generate_step(mx.array(ids), lm.model, max_tokens=n, **quant)

    def timed(n):
        t0, toks, drafted = time.perf_counter(), 0, 0
        for _, *rest in step(n):
            toks += 1
            drafted += bool(rest[-1]) if speculative else 0
        return time.perf_counter() - t0, toks, drafted

    def run():
        t1 = timed(1)[0]
        t, n, drafted = timed(gen)
        return (n - 1) / (t - t1), {"acceptance": round(drafted / n, 3) if speculative else None}

    return run


def measure(runners: dict, repeats: int) -> dict:
    """Every runner once as warm-up, then `repeats` rounds of all of them interleaved (they see
    the same machine load); median tok/s per runner, with its last extra figures."""
    tps = {name: [] for name in runners}
    extra = {}
    for rep in range(repeats + 1):
        for name, run in list(runners.items()):
            try:
                t, extra[name] = run()
            except ValueError as e:  # mlx-lm cannot quantize this head_dim
                extra[name] = {"fails": str(e).splitlines()[0][:100]}
                runners.pop(name)
                continue
            if rep:
                tps[name].append(t)
    return {name: (statistics.median(v) if v else None, extra[name]) for name, v in tps.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--draft-model", default=None, help="default: the target itself")
    ap.add_argument("--prompt-file", default=None)
    ap.add_argument("--story-from", default=None, help="a corpus file: prompt = its first long story + --task")
    ap.add_argument("--task", default="summarise", choices=sorted(TASKS))
    ap.add_argument("--gen", type=int, default=200)
    ap.add_argument("-k", "--num-draft-tokens", type=int, default=4)
    ap.add_argument("--schemes", default="full,affine:8,affine:4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    lm = load_model(a.model)
    draft_lm = load_model(a.draft_model) if a.draft_model else lm
    text = open(a.prompt_file).read() if a.prompt_file else PROMPT
    if a.story_from:
        text = story_prompt(a.story_from, a.task)
    ids = encode_prompt(lm.tokenizer, text)
    rows = []
    for scheme in a.schemes.split(","):
        policy = resolve_policy(SCHEMES[scheme])
        cfg = GenerateConfig()

        def plain():
            tps, _ = run_engine(lambda: Engine(lm.model, lm.tokenizer, policy, 1, cfg), lm, ids, a.gen)
            return tps, {}

        def spec(new_draft):
            def run():
                d = new_draft()
                tps, engine = run_engine(lambda: SpecEngine(lm.model, lm.tokenizer, policy, d, a.num_draft_tokens,
                                                            1, cfg), lm, ids, a.gen, d.models)
                s = engine.stats.to_json()
                return tps, {"acceptance": s["acceptance_rate"], "tokens_per_step": s["tokens_per_step"],
                             "histogram": s["accepted_histogram"]}
            return run

        runners = {"mlxkv plain": plain,
                   "mlxkv draft model": spec(lambda: ModelDraft(draft_lm.model, policy)),
                   "mlxkv prompt lookup": spec(PromptLookup)}
        for name, sp in (("mlx-lm plain", False), ("mlx-lm speculative", True)):
            runners[name] = mlx_lm_runner(lm, draft_lm.model, ids, a.gen, a.num_draft_tokens, sp, SCHEMES[scheme])
        results = measure(runners, a.repeats)
        base = results["mlxkv plain"][0]
        for name, (tps, extra) in results.items():
            speedup = round(tps / base, 2) if name.startswith("mlxkv ") and name != "mlxkv plain" else None
            rows.append({"kv": scheme, "engine": name, "decode_tps": tps and round(tps, 1), "speedup": speedup,
                         **extra})
            print(rows[-1], flush=True)
    meta = {"model": lm.source, "draft": draft_lm.source, "prompt_tokens": len(ids), "gen": a.gen,
            "k": a.num_draft_tokens, "backend": backend_name(), "machine": platform.machine(),
            "date": time.strftime("%Y-%m-%d"), **versions()}
    print(json.dumps(meta))
    print("| KV | engine | decode tok/s | vs plain | acceptance (mlx-lm: tokens from the draft) | tokens/step | accepted histogram |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kv']} | {r['engine']} | {r['decode_tps'] or r.get('fails')} | {r.get('speedup') or '–'} | "
              f"{r.get('acceptance') or '–'} | {r.get('tokens_per_step', '–')} | {r.get('histogram', '–')} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
