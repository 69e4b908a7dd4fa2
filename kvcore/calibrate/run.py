"""A whole calibration: texts -> sensitivities -> a per-layer choice under the budget -> checked configs.

1. capture: per calibration window, one full-precision pass (Q/K/V, reference) and `samples`
   backward passes (output gradients), `capture.py`;
2. sensitivities: every layer's predicted KL for each candidate key and value codec and
   recent window (`proxy.py`, `scores.py`), averaged over windows;
3. choice: a knapsack over layers (`solve.py`), each layer taking its own recent window, or one window
   for all; alternatives shift bits between keys and values (their predictions weighted x2 and x1/2);
4. checks: the first `checks` distinct configs and the best-predicted uniform scheme are measured
   end to end on the calibration windows through their real caches; the best measured is chosen;
5. held-out: the chosen config and the uniform one on text not used to choose (`holdout`, by
   default the sample shipped with kvcore), and the decode speed of each choice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import mlx.core as mx
from mlx.utils import tree_flatten

from ..backend import backend_name, versions
from ..bench.fit import layer_shapes
from ..errors import MlxkvError
from ..fidelity.run import FidelityJob, heldout_texts, text_windows
from ..models import load_model, parse_dtype
from ..policy import KVPolicy, plan_layers
from .budget import Budget, budget_bytes, config_bytes, layer_elements, option_bytes
from .candidates import CandidateSet, LayerOption, parse_candidates
from .capture import capture_window
from .check import Measured, Window, measure, reference
from .config_file import config_entries, config_policy
from .proxy import sample_positions
from .reuse import fingerprint, load_sensitivities
from .scores import LayerScores, average, score_window
from .solve import Item, solve
from .speed import decode_tok_s

Progress = Callable[[int, int, str], None]
LONG_CONTEXT = 32768
CHOICE_STEPS = 6  # decode steps timed per choice (the config itself and full precision: speed.STEPS)


@dataclass(frozen=True)
class CalibrateJob:
    texts: tuple[str, ...]
    budget: Budget
    candidates: str | None = None  # the --kv candidate set (candidates.py); None: the default
    optiq_compatible: bool = False
    model: str | None = None
    dtype: str | None = None
    window_tokens: int = 1024
    windows: int = 1  # per calibration text
    holdout: tuple[str, ...] = ()  # held-out texts; () = the sample shipped with kvcore
    holdout_windows: int = 1
    samples: int = 4  # gradient samples per window
    queries: int = 256  # query positions per window the proxy scores
    checks: int = 3  # calibrated configs measured end to end (the uniform comparator comes on top)
    chunk: int = 64  # tokens per teacher-forced pass in the checks
    seed: int = 0
    sensitivities: str | None = None  # a previous report whose sensitivities to reuse (reuse.py)

    def __post_init__(self):
        if not self.texts:
            raise MlxkvError("no calibration text: pass --text FILE (repeatable)")
        for t in (*self.texts, *self.holdout):
            p = Path(t)
            if not p.is_file():
                raise MlxkvError(f"text file not found: {t}")
            if not p.read_bytes().strip():
                raise MlxkvError(f"text file is empty: {t}")
        for name, v, lo in (("--window-tokens", self.window_tokens, 16), ("--windows", self.windows, 1),
                            ("--holdout-windows", self.holdout_windows, 1), ("--samples", self.samples, 1),
                            ("--queries", self.queries, 1), ("--checks", self.checks, 1), ("--chunk", self.chunk, 1)):
            if v < lo:
                raise MlxkvError(f"{name} must be >= {lo}, got {v}")
        parse_dtype(self.dtype)


@dataclass
class Check:
    name: str
    choices: dict[int, LayerOption]
    predicted: float
    nbytes: int
    measured: Measured | None = None

    def to_json(self, shapes, tokens: int, dtype_bytes: int) -> dict:
        labels = sorted({o.label() for o in self.choices.values()})
        return {"name": self.name, "predicted_kl": self.predicted, "bytes": self.nbytes,
                "choices": labels, **({} if self.measured is None else {"measured": self.measured.to_json()})}


@dataclass
class Calibration:
    entries: list[dict]
    report: dict
    chosen: Check = field(repr=False, default=None)


def _weights(model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def _windows(tokenizer, texts, windows: int, tokens: int) -> list[tuple[str, list[int]]]:
    return text_windows(tokenizer, FidelityJob(list(texts), windows=windows, window_tokens=tokens))


def _model_dtype(model) -> mx.Dtype:
    return next((v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)),
                mx.float32)


class _Steps:
    def __init__(self, total: int, on_progress: Progress | None):
        self.done, self.total, self.cb = 0, total, on_progress

    def __call__(self, what: str, n: int = 1) -> None:
        self.done += n
        if self.cb:
            self.cb(self.done, self.total, what)


def _solutions(cands: CandidateSet, scores: dict[int, LayerScores], shapes, tokens: int, budget: int,
               dtype_bytes: int, checks: int) -> list[Check]:
    """Distinct knapsack solutions, best predicted first: each layer choosing its own recent window, and
    one recent window for all; each with the keys' or the values' predictions weighted x2 as well
    (shifting bits between them where the proxy is off)."""
    layers = sorted(scores)
    out: dict[tuple, Check] = {}
    error = None
    mixed = list(dict.fromkeys(o for r in cands.recents for o in cands.options(r)))
    groups = [("", mixed)] + ([(f" /r{r}", cands.options(r)) for r in cands.recents] if len(cands.recents) > 1 else [])
    for tag, opts in groups:
        nbytes = {i: [option_bytes(shapes[i], o, tokens, dtype_bytes) for o in opts] for i in layers}
        for kw, vw, weight in ((1.0, 1.0, ""), (2.0, 0.5, ", keys x2"), (0.5, 2.0, ", values x2")):
            items = [[Item(scores[i].cost(o, kw, vw), b, o) for o, b in zip(opts, nbytes[i])] for i in layers]
            try:
                picked = solve(items, budget)
            except MlxkvError as e:  # this window does not fit; a smaller one may
                error = error or e
                break
            choices = {i: it.key for i, it in zip(layers, picked)}
            sig = tuple(sorted(choices.items(), key=lambda x: x[0]))
            if sig not in out:
                pred = sum(scores[i].cost(o) for i, o in choices.items())
                out[sig] = Check(f"knapsack{tag}{weight}", choices, pred, sum(it.nbytes for it in picked))
    if not out:
        raise error
    return sorted(out.values(), key=lambda c: c.predicted)[:checks]


def _uniforms(cands: CandidateSet, scores: dict[int, LayerScores], shapes, tokens: int, budget: int,
              dtype_bytes: int) -> list[Check]:
    """Every single option for all layers that fits the budget, best predicted first (the first is the
    uniform scheme measured beside the calibrated configs; the report lists them all)."""
    layers, out = sorted(scores), {}
    for r in cands.recents:
        for o in cands.options(r):
            nbytes = sum(option_bytes(shapes[i], o, tokens, dtype_bytes) for i in layers)
            if nbytes <= budget and o.compresses and o not in out:
                out[o] = Check(f"uniform {o.label()}", {i: o for i in layers}, sum(scores[i].cost(o) for i in layers),
                               nbytes)
    return sorted(out.values(), key=lambda c: c.predicted)


def _check_feasible(cands: CandidateSet, shapes, layers: list[int], tokens: int, budget: int, dtype_bytes: int) -> None:
    """Fail before any work when even the smallest candidate of every layer exceeds the budget."""
    opts = cands.options(0)
    smallest = sum(min(option_bytes(shapes[i], o, tokens, dtype_bytes) for o in opts) for i in layers)
    if smallest > budget:
        solve([[Item(0.0, smallest, None)]], budget)  # raises the knapsack's one-line error


def run_calibrate(job: CalibrateJob, on_progress: Progress | None = None) -> Calibration:
    cands = parse_candidates(job.candidates, job.optiq_compatible)  # bad input fails before the model loads
    holdout = job.holdout or tuple(heldout_texts())
    t_start = time.perf_counter()
    lm = load_model(job.model, job.dtype)
    model, dtype = lm.model, _model_dtype(lm.model)
    shapes = layer_shapes(lm.config)
    kinds = {p.index: p.kind for p in plan_layers(model, KVPolicy())}
    cal = _windows(lm.tokenizer, job.texts, job.windows, job.window_tokens)
    held = _windows(lm.tokenizer, holdout, job.holdout_windows, job.window_tokens)
    tokens = job.budget.context or job.window_tokens
    weights = _weights(model)
    layers = sorted(i for i, k in kinds.items() if k != "other")
    budget = budget_bytes(job.budget, shapes, layers, weights, tokens)  # a budget below the weights fails here
    _check_feasible(cands, shapes, layers, tokens, budget, job.budget.dtype_bytes)
    specs = cands.specs()
    dtype_name = str(dtype).rsplit(".", 1)[-1]
    mark = fingerprint(lm.source, job.texts, job.window_tokens, job.windows, job.samples, job.queries, job.seed,
                       dtype_name)
    reused = None
    if job.sensitivities is not None:
        reused = load_sensitivities(job.sensitivities, mark, specs, cands.recents)
    samples = 0 if reused else job.samples
    per_window = 1 + samples + (0 if reused else len(layers))
    total = len(cal) * per_window + (job.checks + 1) * len(cal) + len(held) * 3 + 4
    step = _Steps(total, on_progress)

    tables, kv_sample, phase = [], None, {}
    t0 = time.perf_counter()
    positions = sample_positions(job.window_tokens, job.queries)
    refs = []
    for n, (name, toks) in enumerate(cal):
        w = capture_window(model, toks, positions, samples, job.seed + n)
        step(f"{name}: captured Q/K/V and {samples} gradient samples", 1 + samples)
        missing = [i for i in layers if i not in w.layers]
        if missing:
            raise MlxkvError(f"calibrate: layer {missing[0]} was not observed attending over its cache")
        if not reused:
            tables.append(score_window(w, specs, cands.recents, lambda i: step(f"{name}: sensitivities, layer {i}")))
        refs.append(Window(name, toks, w.logprobs))
        if kv_sample is None:
            kv_sample = {i: (c.k, c.v) for i, c in w.layers.items()}
        del w
        mx.clear_cache()
    scores = {i: s for i, s in (reused or average(tables)).items() if i in layers}
    phase["sensitivities_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    checks = _solutions(cands, scores, shapes, tokens, budget, job.budget.dtype_bytes, job.checks)
    uniforms = _uniforms(cands, scores, shapes, tokens, budget, job.budget.dtype_bytes)
    uniform = uniforms[0] if uniforms else None
    for c in checks + ([uniform] if uniform else []):
        c.measured = measure(model, refs, config_policy(config_entries(c.choices)), job.chunk)
        step(f"check: {c.name}", len(cal))
    chosen = min(checks + ([uniform] if uniform else []), key=lambda c: c.measured.mean_kl)
    phase["checks_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    entries = config_entries(chosen.choices)
    policy = config_policy(entries)
    held_refs = []
    for name, toks in held:
        held_refs.append(reference(model, name, toks, job.chunk))
        step(f"held-out {name}: reference")
    held_chosen = measure(model, held_refs, policy, job.chunk)
    step("held-out: chosen config", len(held))
    held_uniform = None
    if uniform is not None and uniform is not chosen:
        held_uniform = measure(model, held_refs, config_policy(config_entries(uniform.choices)), job.chunk)
    step("held-out: uniform scheme", len(held))
    phase["heldout_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    token = cal[0][1][-1]
    decode = {"full": decode_tok_s(model, KVPolicy(), kv_sample, token, dtype),
              "chosen": decode_tok_s(model, policy, kv_sample, token, dtype)}
    for o in sorted({o for o in chosen.choices.values() if o.compresses}, key=lambda o: o.label()):
        decode[o.label()] = decode_tok_s(model, config_policy(config_entries({i: o for i in layers})), kv_sample,
                                         token, dtype, steps=CHOICE_STEPS)
    step("decode speed", 4)
    phase["decode_s"] = time.perf_counter() - t0
    phase["total_s"] = time.perf_counter() - t_start

    elements = sum(layer_elements(shapes[i], tokens) for i in layers)
    long_elements = sum(layer_elements(shapes[i], LONG_CONTEXT) for i in layers)
    bits = {str(tokens): 8 * config_bytes(shapes, policy, tokens, job.budget.dtype_bytes) / elements,
            str(LONG_CONTEXT): 8 * config_bytes(shapes, policy, LONG_CONTEXT, job.budget.dtype_bytes) / long_elements}
    report = {
        "type": "calibration", "model": lm.source, "dtype": dtype_name, "fingerprint": mark,
        "sensitivities_from": job.sensitivities,
        "texts": list(job.texts), "holdout": list(holdout), "windows": len(cal), "holdout_windows": len(held),
        "window_tokens": job.window_tokens, "candidates": cands.label(), "optiq_compatible": job.optiq_compatible,
        "budget": {"describe": job.budget.describe(tokens), "bits": job.budget.bits, "memory": job.budget.memory,
                   "context": tokens, "batch": job.budget.batch, "kv_bytes_per_row": budget,
                   "weights_bytes": weights, "dtype_bytes": job.budget.dtype_bytes},
        "samples": job.samples, "queries": int(positions.size), "chunk": job.chunk,
        "chosen": chosen.name, "bytes_per_row": config_bytes(shapes, policy, tokens, job.budget.dtype_bytes),
        "bits_per_element": bits,
        "checks": [c.to_json(shapes, tokens, job.budget.dtype_bytes) for c in checks],
        "uniform": None if uniform is None else uniform.to_json(shapes, tokens, job.budget.dtype_bytes),
        "uniforms_within_budget": [{"scheme": c.name.removeprefix("uniform "), "bytes": c.nbytes,
                                    "bits_per_element": 8 * c.nbytes / elements, "predicted_kl": c.predicted}
                                   for c in uniforms],
        "heldout": {"chosen": held_chosen.to_json(),
                    "uniform": None if held_uniform is None else held_uniform.to_json()},
        "decode_tok_s": decode,
        "layers": [{"layer": i, "choice": chosen.choices[i].label(),
                    "bytes": option_bytes(shapes[i], chosen.choices[i], tokens, job.budget.dtype_bytes),
                    "predicted_kl": scores[i].cost(chosen.choices[i]), "sensitivity": scores[i].to_json()}
                   for i in layers],
        "seconds": {k: round(v, 2) for k, v in phase.items()},
        "backend": backend_name(), "versions": versions(),
    }
    return Calibration(entries, report, chosen)
