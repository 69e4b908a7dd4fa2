"""Reuse a report's sensitivities: solve for another budget without measuring them again.

Sensitivities depend on the model, the calibration windows and the proxy's settings, not on the
budget; a report records them with a fingerprint of those, and `--sensitivities REPORT` reads
them back when the fingerprint matches (else a one-line error naming what differs).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..errors import MlxkvError
from ..policy.kv_spec import parse_kv
from .proxy import Score
from .scores import LayerScores


def fingerprint(model: str, texts, window_tokens: int, windows: int, samples: int, queries: int, seed: int,
                dtype: str) -> dict:
    digests = [hashlib.sha256(Path(t).read_bytes()).hexdigest() for t in texts]
    return {"model": model, "texts_sha256": digests, "window_tokens": window_tokens, "windows": windows,
            "samples": samples, "queries": queries, "seed": seed, "dtype": dtype}


def _entry(label: str):
    s = parse_kv(label)
    return s.key, s.recent


def load_sensitivities(path: str, want: dict, specs, recents) -> dict[int, LayerScores]:
    p = Path(path)
    try:
        report = json.loads(p.read_text())
        got, layers = report["fingerprint"], report["layers"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise MlxkvError(f"--sensitivities {path}: not a calibrate report ({type(e).__name__})") from None
    for k, v in want.items():
        if got.get(k) != v:
            raise MlxkvError(f"--sensitivities {path}: measured with another {k} ({got.get(k)!r}, this run {v!r})")
    out = {}
    for row in layers:
        s = LayerScores()
        for role in ("key", "value"):
            for label, v in row["sensitivity"][role].items():
                getattr(s, role)[_entry(label)] = Score(v["predicted_kl"], v["relative_error"])
        for spec in specs:
            for r in recents:
                if (spec, r) not in s.key:
                    raise MlxkvError(f"--sensitivities {path}: has no {spec.label()}{f'/r{r}' if r else ''} "
                                     f"(measure with that candidate set)")
        out[row["layer"]] = s
    return out
