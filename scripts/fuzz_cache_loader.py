"""Fuzz the KV cache loader: mutate valid cache files, require nothing but MlxkvError.

    python scripts/fuzz_cache_loader.py [--cases 10000] [--seed 0]

Base files: mlxkv caches of the embedded model (compressed sliding window; mlx-lm KVCache),
of a tiny Qwen3.5 (SSM state), and an mlx-lm prompt cache. Each case applies 1-4 random
mutations (byte flips anywhere or in the header, truncation, insertion, header-length edits,
JSON edits of the tensor table or of the mlxkv document) and then opens the file, restores its
caches if it opens, and inspects it. Any exception other than MlxkvError is a failure: the
script prints it with the case's seed and exits 1.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache  # noqa: E402

from fixtures import cache_mutations as m  # noqa: E402
from fixtures.tiny_models import build_tiny_model  # noqa: E402
from kvcore.errors import MlxkvError  # noqa: E402
from kvcore.models import load_model  # noqa: E402
from kvcore.policy import KVOptions  # noqa: E402
from kvcore.jobs.generate import GenerateJob, run_generate  # noqa: E402
from kvcore.store import inspect_cache, open_cache_file  # noqa: E402

PROMPT = "Once upon a time there was a little girl who liked to play in the park"
VALUES = [None, True, False, 0, 1, -1, 2, 3, 4, 7, 8, 16, 32, 64, 128, 2**31, 2**63, 10**30, 0.5, float("nan"),
          "", "float32", "int32", "F32", "U32", "compressed", "kv", "rotating", "arrays", "affine", "full",
          [], [1], [1, 2, 3, 4], [0, 0], {}, {"codec": "affine", "bits": 4, "group_size": 32}]


def base_files(d: Path) -> list[bytes]:
    opts = KVOptions(max_kv_size=40, keep=2, kv_bits=4, kv_group_size=32, quantized_kv_start=0)
    for name, model, kv, n in (("window.kv", None, opts, 24), ("full.kv", None, KVOptions(), 4)):
        run_generate(GenerateJob([PROMPT], model=model, max_tokens=n, kv=kv, save_cache=str(d / name)))
    qwen = build_tiny_model("qwen3_5", d / "qwen3_5")
    run_generate(GenerateJob(["Once upon a time"], model=str(qwen), max_tokens=2, save_cache=str(d / "ssm.kv")))
    lm = load_model(None)
    cache = make_prompt_cache(lm.model)
    lm.model(mx.array(lm.tokenizer.encode("Once upon a time"))[None], cache=cache)
    save_prompt_cache(str(d / "mlx_lm.safetensors"), cache, {"k": "v"})
    return [(d / n).read_bytes() for n in ("window.kv", "full.kv", "ssm.kv", "mlx_lm.safetensors")]


def mutate(data: bytes, rng: random.Random) -> tuple[bytes, list[str]]:
    ops = []
    single_edit = rng.random() < 0.5  # half the cases: one JSON edit, so the file still parses
    for _ in range(1 if single_edit else rng.randint(1, 4)):
        if not data:
            break
        n_header = 8 + int.from_bytes(data[:8], "little")
        kinds = ["doc", "doc", "doc", "header"] if single_edit else ["flip", "flip_head", "cut", "insert", "len"]
        op = rng.choice(kinds)
        ops.append(op)
        try:
            if op == "flip":
                data = m.flip(data, rng.randrange(len(data)), rng.randrange(1, 256))
            elif op == "flip_head":
                data = m.flip(data, rng.randrange(min(n_header, len(data))), 1 << rng.randrange(8))
            elif op == "cut":
                data = m.truncate(data, rng.randrange(len(data)))
            elif op == "insert":
                data = m.insert(data, rng.randrange(len(data) + 1), rng.randbytes(rng.randint(1, 16)))
            elif op == "len":
                data = m.set_length(data, rng.choice([0, 1, n_header - 9, n_header - 7, 2**63, rng.randrange(2**16)]))
            else:
                edit = m.edit_doc if op == "doc" else m.edit_header
                data = edit(data, rng.randrange(10**6), rng.choice(VALUES), delete=rng.random() < 0.2)
        except (ValueError, KeyError, IndexError, TypeError, UnicodeDecodeError, OverflowError):
            ops[-1] += "(skipped: file no longer parses for this edit)"
    return data, ops


def check(path: Path) -> str:
    try:
        cf = open_cache_file(path)
        mx.eval([c.state for c in cf.restore() if hasattr(c, "offset")])
        outcome = "loaded"
    except MlxkvError as e:
        msg = str(e).split(": ", 1)[-1]
        outcome = "refused: " + re.sub(r"\d+", "N", re.sub(r"'[^']*'", "'…'", msg)).split("(")[0][:70]
    try:
        inspect_cache(path)
    except MlxkvError:
        pass
    return outcome


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        bases = base_files(d)
        path = d / "mutant.kv"
        outcomes: Counter = Counter()
        t0 = time.perf_counter()
        for case in range(args.cases):
            rng = random.Random(f"{args.seed}:{case}")
            data, ops = mutate(bases[case % len(bases)], rng)
            path.write_bytes(data)
            try:
                outcomes[check(path)] += 1
            except Exception:  # the failure this script exists to find: report it whole
                print(f"FAIL case {case} (seed {args.seed}, base {case % len(bases)}, ops {ops})")
                traceback.print_exc()
                return 1
        dt = time.perf_counter() - t0
    print(f"{args.cases} cases in {dt:.1f} s: no exception other than MlxkvError")
    for outcome, n in outcomes.most_common(40):
        print(f"{n:7d}  {outcome}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
