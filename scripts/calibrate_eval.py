"""Issue 16's held-out comparison: calibrated kv_configs against other schemes on the pinned evaluation
texts of scripts/fidelity-smollm2 (the same files, character ranges, 2 x 1024-token windows each, 64-token
chunks), paired window by window.

    python scripts/calibrate_eval.py OUT.json --base config:kv4.json --kv 'turbo:k4v3/r16,turbo:3/r16,...'

Writes fidelity's rows (mlx-lm rows off) plus, per scheme, each window's mean KL, and for every other scheme
the pooled KL reduction of --base against it (1 - KL_base / KL_other) and the same per window (min, and how
many windows --base wins).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from kvcore.bench.fit import layer_shapes
from kvcore.calibrate.budget import config_bytes, layer_elements
from kvcore.fidelity import pool
from kvcore.fidelity.run import FidelityJob, run_fidelity
from kvcore.fidelity.schemes import parse_schemes
from kvcore.policy.kv_spec import split_kv_list

REPO = Path(__file__).resolve().parents[1]
CORPORA = REPO.parent / "shared/assets/corpora"
STDLIB = Path("/usr/lib/python3.11")
CHARS = 12000
LONG = 32768


def eval_texts(tmp: Path) -> list[str]:
    """The three texts of scripts/fidelity-smollm2: each file's first 12,000 characters."""
    code = "".join((STDLIB / f).read_text(encoding="utf-8") for f in ("argparse.py", "functools.py", "dataclasses.py"))
    texts = {"tinystories_val_head.txt": (CORPORA / "tinystories_val_head.txt").read_text(encoding="utf-8"),
             "tinyshakespeare.txt": (CORPORA / "tinyshakespeare.txt").read_text(encoding="utf-8"),
             "python-stdlib-code.txt": code}
    out = []
    for name, text in texts.items():
        (tmp / name).write_text(text[:CHARS], encoding="utf-8")
        out.append(str(tmp / name))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--base", required=True, help="the scheme compared against every other (e.g. config:kv4.json)")
    ap.add_argument("--kv", required=True, help="the other schemes, comma-separated")
    ap.add_argument("--model", default=str(Path.home() / ".cache/mlxkv/models/SmolLM2-135M-Instruct-f32"))
    ap.add_argument("--windows", type=int, default=2)
    a = ap.parse_args()
    schemes = [a.base, *split_kv_list(a.kv)]
    with tempfile.TemporaryDirectory() as d:
        job = FidelityJob(eval_texts(Path(d)), ",".join(schemes), a.model, "float32", 64, a.windows, 1024, False)
        report = run_fidelity(job, lambda n, t, what: print(f"[{n}/{t}] {what}", file=sys.stderr, flush=True))
    rows = {r.scheme: r for r in report.rows}
    base = report.rows[0]
    data = report.to_json()
    shapes = layer_shapes(json.loads((Path(a.model) / "config.json").read_text()))
    long_elements = sum(layer_elements(s, LONG) for s in shapes)
    for r, js, sc in zip(report.rows, data["rows"], parse_schemes(",".join(schemes), False), strict=True):
        js["per_window_kl"] = [pool([s]).mean_kl for s in r.stats]
        js[f"bits_per_element_{LONG}"] = 8 * config_bytes(shapes, sc.policy, LONG, 2) / long_elements
    bw = data["rows"][0]["per_window_kl"]
    data["base"] = base.scheme
    data["against_base"] = []
    for name, r in list(rows.items())[1:]:
        js = next(x for x in data["rows"] if x["scheme"] == name)
        if r.error is not None:
            continue
        ow = js["per_window_kl"]
        per = [1 - b / o for b, o in zip(bw, ow)]
        data["against_base"].append({
            "scheme": name, "bits_per_element": js["bits_per_element"], "mean_kl": js["mean_kl"],
            f"bits_per_element_{LONG}": js[f"bits_per_element_{LONG}"],
            "reduction_pooled": 1 - data["rows"][0]["mean_kl"] / js["mean_kl"],
            "reduction_per_window": per, "reduction_min": min(per), "base_wins": sum(p > 0 for p in per)})
    Path(a.out).write_text(json.dumps(data, indent=1) + "\n")
    for x in data["against_base"]:
        print(f"{x['scheme']}: {x['bits_per_element']:.3f} bits, KL {x['mean_kl']:.4f}, base {data['rows'][0]['mean_kl']:.4f}, "
              f"reduction {100 * x['reduction_pooled']:.1f}% (min window {100 * x['reduction_min']:.1f}%, "
              f"wins {x['base_wins']}/{len(bw)})")


if __name__ == "__main__":
    main()
