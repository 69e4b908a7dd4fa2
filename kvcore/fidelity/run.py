"""A whole fidelity run: texts -> token windows -> each scheme against full precision.

For every window the reference is the same model with full-precision KV on the same tokens;
each scheme then feeds the window teacher-forced in chunks through its real caches (so
attention reads the compressed cache, as in generation). Positions of all windows pool into
one row per scheme; KV bytes are counted at the end of each window (`bytes.py`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import mlx.core as mx

from ..backend import backend_name, versions
from ..bench.fit import layer_shapes
from ..errors import MlxkvError, first_line
from ..models import load_model, parse_dtype
from ..policy import KVPolicy, build_caches
from .bytes import KVBytes, kv_bytes
from .schemes import Scheme, parse_schemes, scheme_note
from .teacher_forced import (
    Fidelity,
    TokenStats,
    pool,
    teacher_forced_chunk,
    teacher_forced_logprobs,
    teacher_forced_stats,
)

CHARS_PER_TOKEN = 16  # generous: text prefix tokenized before falling back to the whole text
HELDOUT = Path(__file__).resolve().parents[1] / "assets" / "heldout"  # public domain sample (LICENSE there)


def heldout_texts() -> list[str]:
    """The held-out sample shipped with kvcore: what fidelity reads without --text."""
    return [str(p) for p in sorted(HELDOUT.glob("*.txt"))]


@dataclass
class FidelityJob:
    texts: list[str]  # empty: the shipped held-out sample (`heldout_texts`)
    schemes: str = "full,affine:8,affine:4,turbo:k4v3"  # comma-separated, see schemes.py
    model: str | None = None
    dtype: str | None = None
    chunk: int | None = None  # None: the largest the memory allows (teacher_forced.teacher_forced_chunk)
    windows: int = 1  # per text
    window_tokens: int = 1024
    baselines: bool = True  # add mlx-lm's QuantizedKVCache beside each affine scheme


@dataclass
class SchemeRow:
    scheme: str
    engine: str
    stats: list[TokenStats] = field(default_factory=list)
    per_text: dict[str, list[TokenStats]] = field(default_factory=dict)
    kv: list[KVBytes] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None
    note: str | None = None  # why the scheme cannot suit the model (schemes.scheme_note)

    def to_json(self) -> dict:
        out = {"scheme": self.scheme, "engine": self.engine, "error": self.error, "note": self.note}
        if self.error is not None or not self.stats:
            return out
        f: Fidelity = pool(self.stats)
        kv = self.kv[-1]
        out.update(
            mean_kl=f.mean_kl, p99_kl=f.p99_kl, top1_agreement=f.top1_agreement,
            ppl=f.ppl, ppl_reference=f.ppl_reference, ppl_delta=f.ppl / f.ppl_reference - 1,
            bits_per_element=sum(k.bits_per_element for k in self.kv) / len(self.kv),
            kv_bytes=kv.deployed, nbytes=kv.nbytes, kv_elements=kv.elements,
            per_text={t: pool(s).mean_kl for t, s in self.per_text.items()},
            positions=sum(len(s.kl) for s in self.stats), seconds=round(self.seconds, 2),
        )
        return out


@dataclass
class FidelityReport:
    rows: list[SchemeRow]
    meta: dict

    def to_json(self) -> dict:
        return {"type": "fidelity", **self.meta, "rows": [r.to_json() for r in self.rows]}


def _check(job: FidelityJob) -> None:
    if job.chunk is not None and job.chunk < 1:
        raise MlxkvError(f"--chunk must be >= 1, got {job.chunk}")
    if job.windows < 1 or job.window_tokens < 2:
        raise MlxkvError(f"--windows must be >= 1 and --window-tokens >= 2, got {job.windows}, {job.window_tokens}")
    if not job.texts:
        job.texts = heldout_texts()
    for t in job.texts:
        if not Path(t).is_file():
            raise MlxkvError(f"text file not found: {t}")
    parse_dtype(job.dtype)


def text_windows(tokenizer, job: FidelityJob) -> list[tuple[str, list[int]]]:
    """(text name, tokens) windows: the first `windows` x `window_tokens` tokens of each text."""
    out, need = [], job.windows * job.window_tokens
    for t in job.texts:
        try:
            text = Path(t).read_text()
        except UnicodeDecodeError:
            raise MlxkvError(f"text file is not UTF-8: {t}")
        ids = _encode(tokenizer, text[: need * CHARS_PER_TOKEN])  # a prefix is enough (and quick)
        if len(ids) < need and len(text) > need * CHARS_PER_TOKEN:
            ids = _encode(tokenizer, text)
        n = min(job.windows, len(ids) // job.window_tokens)
        if n == 0:
            raise MlxkvError(f"text {t} has {len(ids)} tokens, fewer than --window-tokens {job.window_tokens}")
        T = job.window_tokens
        out += [(Path(t).name, ids[i * T : (i + 1) * T]) for i in range(n)]
    return out


def _encode(tokenizer, text: str) -> list[int]:
    """Token ids, without transformers' warning that the text is longer than the model's context."""
    log = logging.getLogger("transformers.tokenization_utils_base")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        return tokenizer.encode(text)
    finally:
        log.setLevel(level)


def _measure(row: SchemeRow, scheme: Scheme, model, name: str, tokens: list[int], ref, chunk: int) -> None:
    t0 = time.perf_counter()
    try:
        caches = scheme.caches(model)
        s = teacher_forced_stats(model, tokens, caches, ref, chunk)
    except (ValueError, RuntimeError, MlxkvError) as e:  # e.g. mx.quantize: group does not divide head_dim
        row.error = first_line(e, limit=None)
        return
    row.stats.append(s)
    row.per_text.setdefault(name, []).append(s)
    row.kv.append(kv_bytes(caches))
    row.seconds += time.perf_counter() - t0


def run_fidelity(job: FidelityJob, on_progress: Callable[[int, int, str], None] | None = None) -> FidelityReport:
    """`on_progress(done, total, what)` after each (window, scheme) step."""
    _check(job)
    schemes = parse_schemes(job.schemes, job.baselines)  # bad schemes fail before the model loads
    lm = load_model(job.model, job.dtype)
    windows = text_windows(lm.tokenizer, job)
    shapes = layer_shapes(lm.config)
    rows = [SchemeRow(s.name, s.engine, note=scheme_note(s.policy, shapes)) for s in schemes]
    total, done = len(windows) * (len(schemes) + 1), 0
    chunk = job.chunk or teacher_forced_chunk(lm.model, lm.config, job.window_tokens)
    for name, tokens in windows:
        ref = teacher_forced_logprobs(lm.model, tokens, build_caches(lm.model, KVPolicy())[0], chunk)
        done += 1
        if on_progress:
            on_progress(done, total, f"{name}: reference")
        for scheme, row in zip(schemes, rows):
            if row.error is None:
                _measure(row, scheme, lm.model, name, tokens, ref, chunk)
            done += 1
            if on_progress:
                on_progress(done, total, f"{name}: {scheme.name}")
        del ref
        mx.clear_cache()
    dtype = job.dtype or _float_dtype(lm.model)
    meta = {"model": lm.source, "texts": job.texts, "windows": len(windows), "window_tokens": job.window_tokens,
            "chunk": chunk, "dtype": dtype, "backend": backend_name(), "versions": versions()}
    return FidelityReport(rows, meta)


def _float_dtype(model) -> str:
    """The dtype of the model's floating-point weights (what activations run in)."""
    from mlx.utils import tree_flatten

    dtypes = [v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)]
    return str(dtypes[0]).rsplit(".", 1)[-1] if dtypes else "unknown"
