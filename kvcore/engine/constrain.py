"""Constrained decoding: a JSON schema, a regex or a Lark grammar as a token mask per row.

The engine is llguidance (measured against xgrammar and outlines-core on SmolLM2's 49k-token
vocabulary, BENCHMARKS.md): no torch dependency (xgrammar pulls torch and its CUDA wheels),
grammars as well as schemas and regexes (outlines-core has no context-free grammars), schemas
compiled in milliseconds (outlines-core: ~0.5 s) and ~60 us a mask.

A row's `Constraint` holds its matcher: `mask()` allows the tokens that keep the output inside
the language (its end token once the output is complete), `consume(tok)` advances it. The
mask is applied to the row's logits before sampling (a forbidden token gets -inf), so greedy
and sampled rows, alone, batched or speculative, only ever emit allowed tokens; in speculative
rounds every verified position gets the mask of the prefix before it, so a draft that breaks
the constraint is rejected there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import MlxkvError, first_line

KINDS = ("json_schema", "regex", "grammar")
FLAGS = {"json_schema": "--json-schema", "regex": "--regex", "grammar": "--grammar"}


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        raise MlxkvError("constrained decoding needs llguidance: pip install 'mlxkv[constrain]'") from None
    old = too_old(getattr(llguidance, "__version__", None) or _dist_version("llguidance"))
    if old:
        raise MlxkvError(f"constrained decoding needs llguidance >= {'.'.join(map(str, LLGUIDANCE_MIN))} (found "
                         f"{old}: it takes one EOS token, not a tokenizer's list): pip install -U 'mlxkv[constrain]'")
    return llguidance


LLGUIDANCE_MIN = (1, 7)  # the first llguidance whose from_tokenizer takes a list of EOS tokens


def too_old(version: str | None) -> str | None:
    """`version` when it is below LLGUIDANCE_MIN (unparsable or unknown versions pass)."""
    try:
        parts = tuple(int(x) for x in (version or "").split(".")[:2])
    except ValueError:
        return None
    return version if len(parts) == 2 and parts < LLGUIDANCE_MIN else None


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


@dataclass(frozen=True)
class ConstraintSpec:
    """What a row's output must match: kind is json_schema (the schema as JSON text), regex or
    grammar (Lark text)."""

    kind: str
    source: str

    def __post_init__(self):
        if self.kind not in KINDS:
            raise MlxkvError(f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.source, str) or not self.source.strip():
            raise MlxkvError(f"{FLAGS[self.kind]} is empty")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.source)
            except (json.JSONDecodeError, RecursionError) as e:
                raise MlxkvError(f"--json-schema is not JSON: {first_line(e, None)}") from None
            if not isinstance(schema, (dict, bool)):
                raise MlxkvError("--json-schema must be a JSON object (a schema)")

    @classmethod
    def from_flag(cls, kind: str, value: str) -> "ConstraintSpec":
        """A flag's value: inline text, or a file holding it (--grammar always names a file)."""
        path = Path(value)
        looks_inline = kind == "regex" or (kind == "json_schema" and value.lstrip()[:1] in "{[")
        if not looks_inline:
            if not path.is_file():
                raise MlxkvError(f"{FLAGS[kind]} file not found: {value}")
            try:
                value = path.read_text()
            except UnicodeDecodeError:
                raise MlxkvError(f"{FLAGS[kind]} file is not UTF-8 text: {path}") from None
        return cls(kind, value)

    def grammar(self) -> str:
        m = _llguidance().LLMatcher
        if self.kind == "json_schema":
            return m.grammar_from_json_schema(self.source, defaults={"whitespace_flexible": False})
        if self.kind == "regex":
            return m.grammar_from_regex(self.source)
        return m.grammar_from_lark(self.source)


_TOKENIZERS: dict[int, tuple] = {}


def ll_tokenizer(tokenizer):
    """The llguidance view of an mlx-lm tokenizer (built once per tokenizer: ~1 s on 49k tokens)."""
    key = id(tokenizer)
    if key not in _TOKENIZERS:
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        eos = sorted(getattr(tokenizer, "eos_token_ids", None) or []) or None
        try:
            view = _llguidance().hf.from_tokenizer(hf, eos_token=eos)
        except Exception as e:  # not a fast (Rust) HF tokenizer
            raise MlxkvError(f"constrained decoding cannot use this tokenizer ({type(e).__name__}: "
                             f"{first_line(e, None, empty='')})") from None
        _TOKENIZERS[key] = (tokenizer, view)  # the tokenizer kept alive: its id is never reused
    return _TOKENIZERS[key][1]


def check(spec: ConstraintSpec, tokenizer) -> str:
    """The compiled grammar; a schema, regex or grammar that does not compile is one line."""
    ll = _llguidance()
    grammar = spec.grammar()
    error = ll.LLMatcher.validate_grammar(grammar, ll_tokenizer(tokenizer))
    if error:
        raise MlxkvError(f"{FLAGS[spec.kind]} does not compile: {' '.join(error.split())[:300]}")
    return grammar


class Constraint:
    """One row's matcher over its generated tokens."""

    def __init__(self, spec: ConstraintSpec, tokenizer):
        ll = _llguidance()
        self.spec = spec
        self.matcher = ll.LLMatcher(ll_tokenizer(tokenizer), check(spec, tokenizer), log_level=0)

    def bits(self) -> np.ndarray:
        """The allowed tokens now, one bool per tokenizer id."""
        raw = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(raw, bitorder="little").astype(bool)

    def consume(self, tok: int) -> bool:
        return self.matcher.consume_token(tok)

    def rollback(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)

    @property
    def failed(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


def apply_masks(logits: mx.array, masks: list[np.ndarray | None]) -> mx.array:
    """logits (B, ..., V), masks one per row (bools over the tokenizer's ids, or None: all
    allowed, shape (...) + ids) -> forbidden tokens at -inf. Ids past the tokenizer's (a padded
    embedding) are forbidden in constrained rows."""
    V = logits.shape[-1]
    rows = []
    for m in masks:
        if m is None:
            rows.append(np.ones(logits.shape[1:], dtype=bool))
            continue
        full = np.zeros(m.shape[:-1] + (V,), dtype=bool)
        n = min(V, m.shape[-1])
        full[..., :n] = m[..., :n]
        rows.append(full)
    allowed = mx.array(np.stack(rows))
    return mx.where(allowed, logits, mx.array(-float("inf"), dtype=logits.dtype))


def verify_masks(rows, drafts: list[list[int]], K: int) -> list[np.ndarray | None]:
    """Per row (K, ids) masks for a speculative pass over [pending, d1 .. dc]: position j gets
    the mask after d1 .. dj; the first draft the constraint forbids ends the row's walk (its
    position's mask forbids it, so it is rejected there). The matchers are rolled back."""
    out = []
    for row, d in zip(rows, drafts):
        c = row.constraint
        if c is None:
            out.append(None)
            continue
        masks, fed, m = [], 0, None
        for j in range(K):
            if j == fed:  # still walking the drafts: the mask after d1 .. dj
                m = c.bits()
            masks.append(m)  # past the walk: never used (a draft was rejected before)
            if j == fed and j < len(d) and d[j] < m.shape[0] and m[d[j]] and c.consume(d[j]):
                fed += 1
        c.rollback(fed)
        out.append(np.stack(masks))
    return out
