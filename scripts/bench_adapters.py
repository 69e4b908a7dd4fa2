"""Per-row LoRA adapters in one batch (issue 18): the two designs, decode tok/s of the same rows.

- gathered: one forward over every row; each adapted layer gathers its rows' A and B
  (kvcore/adapter_set.py's GatheredLoRA through mx.gather_mm);
- grouped: the rows split by adapter, each group with its own caches, one forward per group a
  step with that group's adapter selected (the layers' single-adapter path: no gather).

Both run the same model with the same adapters installed, greedy, one read-back a step; the
baseline "one adapter" is every row through adapter 1 (mlx-lm's LoRALinear computation).

    python scripts/bench_adapters.py [-m MODEL_DIR] [--rows 8] [--adapters 3] [--steps 32] [--out FILE]

Without -m it builds the tiny llama fixture (tests/fixtures). The adapters are random LoRA
folders (rank 8) written for the model.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from fixtures.lora import make_adapter  # noqa: E402
from fixtures.tiny_models import build_tiny_model  # noqa: E402
from kvcore.adapter_set import AdapterSet  # noqa: E402
from kvcore.backend import backend_name, versions  # noqa: E402
from kvcore.models import load_model  # noqa: E402
from kvcore.policy import KVOptions, build_caches, resolve_policy  # noqa: E402

PROMPT = "Once upon a time there was a little dog who liked to run in the park"


def prefill(lm, rows: int):
    caches = build_caches(lm.model, resolve_policy(KVOptions()))[0]
    ids = lm.tokenizer.encode(PROMPT)
    logits = lm.model(mx.array([ids] * rows), cache=caches)[:, -1, :]
    y = mx.argmax(logits, axis=-1)
    mx.eval(y, [c.state for c in caches])
    return caches, y


def gathered(lm, aset: AdapterSet, which: list[int], steps: int) -> float:
    aset.select(which)
    caches, y = prefill(lm, len(which))
    t0 = time.perf_counter()
    for _ in range(steps):
        aset.select(which)
        y = mx.argmax(lm.model(y[:, None], cache=caches)[:, -1, :], axis=-1)
        y.tolist()
    return len(which) * steps / (time.perf_counter() - t0)


def grouped(lm, aset: AdapterSet, which: list[int], steps: int) -> float:
    groups = sorted(set(which))
    state = {}
    for g in groups:
        aset.select([g])
        state[g] = prefill(lm, which.count(g))
    t0 = time.perf_counter()
    for _ in range(steps):
        outs = []
        for g in groups:
            caches, y = state[g]
            aset.select([g])
            y = mx.argmax(lm.model(y[:, None], cache=caches)[:, -1, :], axis=-1)
            state[g] = (caches, y)
            outs.append(y)
        mx.concatenate(outs).tolist()  # one read-back a step, as the engine
    return len(which) * steps / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=None, help="a model folder (default: the tiny llama fixture)")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--adapters", type=int, default=3, help="adapters among the rows (rows cycle none, 1, .., N)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-adapters-"))
    model_dir = Path(a.model) if a.model else build_tiny_model("llama", tmp / "llama")
    folders = [make_adapter(model_dir, tmp / f"lora{i}", rank=a.rank, seed=i) for i in range(a.adapters)]
    lm = load_model(str(model_dir))
    aset = AdapterSet(lm.model, folders)
    which = [i % (a.adapters + 1) for i in range(a.rows)]  # 0: no adapter
    gathered(lm, aset, which, 4), grouped(lm, aset, which, 4)  # warm-up
    res = {"gathered": [], "grouped": [], "one_adapter": []}
    for _ in range(a.repeats):  # alternated, so all see the same load on shared cores
        res["gathered"].append(round(gathered(lm, aset, which, a.steps), 1))
        res["grouped"].append(round(grouped(lm, aset, which, a.steps), 1))
        res["one_adapter"].append(round(gathered(lm, aset, [1] * a.rows, a.steps), 1))
    median = {k: statistics.median(v) for k, v in res.items()}
    doc = {"model": str(a.model or "tiny llama fixture"), "rows": a.rows, "adapters": a.adapters, "rank": a.rank,
           "steps": a.steps, "backend": backend_name(), "machine": platform.platform(), "date": time.strftime("%Y-%m-%d"),
           "versions": versions(), "decode_tps": res, "median_decode_tps": median,
           "gathered_over_grouped": round(median["gathered"] / median["grouped"], 2)}
    print(json.dumps(doc))
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
