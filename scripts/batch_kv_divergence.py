"""Why a batched greedy row can leave its single-row twin with 4-bit KV (issue 19), measured.

    python scripts/batch_kv_divergence.py [-m MODEL] [-n TOKENS] [--output out.json]

Runs each prompt alone and all of them batched through mlxkv (greedy, `--kv-bits 4
--quantized-kv-start 0`), then compares, for every key and value vector the batched run hands its
caches, the single-row run's vector for the same row and position (tests/fixtures/kv_trace.py):
the largest float difference, how many vectors differ at all, and how many 4-bit codes differ (bin
flips: the same element quantized to another level) in the caches a diverging row held when it
chose its first different token. Then the batched run again with every K/V vector forced to the
single-row one: if the rows now all agree, the K/V inputs were the whole difference. Also full
precision, batched vs single. Default model: SmolLM2-135M-Instruct (scripts/get-eval-model).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from fixtures.kv_trace import KVTrace  # noqa: E402

from kvcore import models  # noqa: E402
from kvcore.backend import backend_name, versions  # noqa: E402
from kvcore.codecs import CodecSpec, make_codec  # noqa: E402
from kvcore.engine.prompts_file import PromptSpec  # noqa: E402
from kvcore.policy import KVOptions  # noqa: E402
from kvcore.jobs.generate import GenerateJob, run_generate  # noqa: E402
from kvcore.jobs.batch import BatchOptions, run_batch  # noqa: E402

SMOL = Path(os.environ.get("MLXKV_HOME", Path.home() / ".cache/mlxkv")) / "models/SmolLM2-135M-Instruct-f32"
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one sentence.",
           "List three prime numbers.", "Who wrote Hamlet?", "Give me a tip for learning Python.",
           "What is 12 times 13?", "Describe a cat to a child."]


def encode(x: np.ndarray, heads: int, group: int, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Vectors x (N, H*D) through mlxkv's own affine codec: integer levels (N, H*D) and the
    float16 scales and biases (N, H*D/group) it stores, as float32 for comparison."""
    N = x.shape[0]
    codec = make_codec(CodecSpec("affine", bits, group), x.shape[1] // heads)
    w, scales, biases = codec.encode(mx.array(x.reshape(N, heads, 1, -1)))
    w = np.array(w).reshape(N, -1)
    shifts = np.arange(32 // bits, dtype=np.uint32) * bits
    levels = ((w[..., None] >> shifts) & ((1 << bits) - 1)).reshape(N, -1)
    return levels, np.array(scales.astype(mx.float32)).reshape(N, -1), np.array(biases.astype(mx.float32)).reshape(N, -1)


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def run_rows(trace: KVTrace, kv: KVOptions, n: int, record: bool) -> dict[int, dict]:
    rows = {}
    for i, prompt in enumerate(PROMPTS):
        if record:
            with trace.recording(i):
                c = run_generate(GenerateJob([prompt], model="traced", max_tokens=n + 1, kv=kv)).completions[0]
        else:
            c = run_generate(GenerateJob([prompt], model="traced", max_tokens=n + 1, kv=kv)).completions[0]
        rows[i] = {"prompt_tokens": c.prompt_tokens, "tokens": c.token_ids[:n]}
    return rows


def batched(trace: KVTrace, kv: KVOptions, n: int, mode: str | None) -> dict[int, list[int]]:
    specs = [PromptSpec(p, str(i)) for i, p in enumerate(PROMPTS)]
    job = GenerateJob([], model="traced", max_tokens=n, kv=kv)
    if mode is None:
        out = run_batch(job, specs, BatchOptions(len(specs))).completions
    else:
        with trace.watching(force=mode == "force"):
            out = run_batch(job, specs, BatchOptions(len(specs))).completions
    return {i: c.token_ids for i, c in enumerate(out)}


TWIN = 0.05  # relative distance within which a batched vector is its row's twin (other rows: ~1)


def flips_at_divergence(trace: KVTrace, single: dict, row: int, d: int, group: int, bits: int) -> dict:
    """Over the K/V of the generated tokens the row's caches held when it chose generated token d (vectors
    within TWIN of their single-run twin; a row that diverged drifts further after a while):
    differences and bin flips, and the first flip in time with the difference that caused it. (The
    prompt is prefilled one row at a time in both runs: same shapes, identical K/V.)"""
    start, limit = single[row]["prompt_tokens"], single[row]["prompt_tokens"] + d
    pairs = [m for m in trace.matches if m[0] == row and start <= m[1] < limit and m[5] < TWIN]  # in time order
    if not pairs:
        return {"positions": [start, limit], "vectors": 0}
    got = np.stack([m[6] for m in pairs]).astype(np.float32)
    ref = np.stack([m[7] for m in pairs]).astype(np.float32)
    heads = trace.kv_heads[0]
    (lg, sg, bg), (lr, sr, br) = encode(got, heads, group, bits), encode(ref, heads, group, bits)
    codes, scales, biases = lg != lr, sg != sr, bg != br
    stored = codes.any(axis=1) | scales.any(axis=1) | biases.any(axis=1)  # vectors whose stored form differs
    if not stored.any():
        return {"positions": [start, limit], "vectors": len(pairs), "vectors_stored_differently": 0,
                "vectors_differing": int((got != ref).any(axis=1).sum())}
    first = int(np.argmax(stored))
    rel = np.linalg.norm(got - ref, axis=1) / np.maximum(np.linalg.norm(ref, axis=1), 1e-30)
    m = pairs[first]
    if codes[first].any():
        j = int(np.argmax(codes[first]))
        what = (f"code {int(lr[first, j])} -> {int(lg[first, j])} (element {got[first, j]:.7g} vs "
                f"{ref[first, j]:.7g} at level {(ref[first, j] - br[first, j // group]) / sr[first, j // group]:.5f})")
    else:
        kind = "scale" if scales[first].any() else "bias"
        arr_g, arr_r = (sg, sr) if kind == "scale" else (bg, br)
        g = int(np.argmax(arr_g[first] != arr_r[first]))
        what = f"float16 {kind} {arr_r[first, g]:.6g} -> {arr_g[first, g]:.6g} (one float16 step)"
    return {"positions": [start, limit], "vectors": len(pairs),
            "vectors_differing": int((got != ref).any(axis=1).sum()), "vectors_stored_differently": int(stored.sum()),
            "elements": int(lg.size), "code_flips": int(codes.sum()), "scale_flips": int(scales.sum()),
            "bias_flips": int(biases.sum()),
            "max_level_change": int(np.abs(lg.astype(int) - lr.astype(int)).max()),
            "max_relative_difference_before_first": float(rel[:first].max()) if first else 0.0,
            "max_relative_difference_after": float(rel[first:].max()),
            "first": {"position": m[1], "layer": m[2], "kind": "key" if m[3] == "k" else "value",
                      "relative_difference_of_its_vector": float(rel[first]), "what": what},
            "layers_stored_differently": sorted({int(m[2]) for m, f in zip(pairs, stored) if f})}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=str(SMOL))
    ap.add_argument("-n", "--max-tokens", type=int, default=64)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--output", type=Path)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    lm = models.load_model(args.model)
    trace = KVTrace(lm.model)
    head_dim = lm.model.layers[0].self_attn.v_proj.inner.weight.shape[0] // trace.kv_heads[0]
    if head_dim % args.group:
        sys.exit(f"head_dim {head_dim} is not a multiple of --group {args.group}: this script reads the per-token "
                 f"(head_dim) layout only")
    models.load_model = lambda *a, **k: lm  # every run below uses this one (traced) model
    q4 = KVOptions(kv_bits=4, kv_group_size=args.group, quantized_kv_start=0)
    n = args.max_tokens

    single = run_rows(trace, q4, n, record=True)
    watched = batched(trace, q4, n, "watch")
    report = {"model": lm.source, "max_tokens": n, "kv": f"affine:4/g{args.group}, start 0",
              "command": "python scripts/batch_kv_divergence.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
              "backend": backend_name(), "blas": os.environ.get("LD_PRELOAD") or "bundled", **versions(), "rows": []}
    for i in single:
        d = first_difference(single[i]["tokens"], watched[i])
        row = {"row": i, "prompt": PROMPTS[i], "prompt_tokens": single[i]["prompt_tokens"], "diverges_at": d}
        # a diverging row: the caches it held when it chose its first different token; an equal row: all of them
        row["kv"] = flips_at_divergence(trace, single, i, n if d is None else d, args.group, 4)
        report["rows"].append(row)
    forced = batched(trace, q4, n, "force")
    report["q4_equal_rows"] = sum(first_difference(single[i]["tokens"], watched[i]) is None for i in single)
    report["q4_forced_kv_equal_rows"] = sum(first_difference(single[i]["tokens"], forced[i]) is None for i in single)
    full_single = run_rows(trace, KVOptions(), n, record=False)
    full_batched = batched(trace, KVOptions(), n, None)
    report["full_equal_rows"] = sum(first_difference(full_single[i]["tokens"], full_batched[i]) is None
                                    for i in full_single)
    report["rows_total"] = len(PROMPTS)
    report["seconds"] = round(time.perf_counter() - t0, 1)

    for r in report["rows"]:
        a = r["kv"]
        if r["diverges_at"] is None:
            line = (f"row {r['row']}: equal; {a.get('vectors_differing', 0)} of {a['vectors']} generated-token K/V vectors "
                    f"differ from the single run, {a.get('vectors_stored_differently', 0)} stored differently")
        else:
            f = a["first"]
            line = (f"row {r['row']}: diverges at generated token {r['diverges_at']}; its generated tokens' K/V then: "
                    f"{a['vectors_differing']} of {a['vectors']} vectors differ from the single run, "
                    f"{a['vectors_stored_differently']} are stored differently ({a['code_flips']} of {a['elements']} "
                    f"4-bit codes, {a['scale_flips']} float16 scales, {a['bias_flips']} biases); the first stored "
                    f"difference: position {f['position']}, layer {f['layer']} {f['kind']}, {f['what']}, from a vector "
                    f"{f['relative_difference_of_its_vector']:.1e} (relative) apart; before it vectors differ by <= "
                    f"{a['max_relative_difference_before_first']:.1e}, after it by <= "
                    f"{a['max_relative_difference_after']:.1e}")
        print(line)
    print(f"4-bit: {report['q4_equal_rows']}/{len(PROMPTS)} rows equal; with the K/V forced to the single run's: "
          f"{report['q4_forced_kv_equal_rows']}/{len(PROMPTS)}; full precision: {report['full_equal_rows']}/{len(PROMPTS)}"
          f" ({report['seconds']} s)")
    if args.output:
        args.output.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
