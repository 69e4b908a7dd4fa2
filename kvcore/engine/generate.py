"""One row's generation: prefill, decode, sampling, stop conditions (EOS, stop strings)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import mlx.core as mx
import mlx.nn as nn

from .forward import DEFAULT_PREFILL_CHUNK, forward, prefill
from .sampling import SamplingConfig
from .stops import StopMatcher


@dataclass(frozen=True)
class Request:
    prompt_ids: tuple[int, ...]
    max_tokens: int = 256
    id: str = "0"
    stop: tuple[str, ...] = ()


@dataclass
class Completion:
    id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "eos" | "stop" | "length"
    prompt_tokens: int = 0
    prompt_time: float = 0.0
    gen_time: float = 0.0
    eos_token: int | None = None  # the EOS that ended it (fed to the caches, not in token_ids)

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_time if self.prompt_time else 0.0

    @property
    def gen_tps(self) -> float:
        return len(self.token_ids) / self.gen_time if self.gen_time else 0.0

    def to_json(self) -> dict:
        return {
            "type": "completion", "id": self.id, "text": self.text, "token_ids": self.token_ids,
            "finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens,
            "generated_tokens": len(self.token_ids), "prompt_time_s": round(self.prompt_time, 4),
            "generation_time_s": round(self.gen_time, 4), "prompt_tps": round(self.prompt_tps, 2),
            "generation_tps": round(self.gen_tps, 2),
        }


@dataclass(frozen=True)
class GenerateConfig:
    sampling: SamplingConfig = SamplingConfig()
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK


def decode_tokens(model: nn.Module, caches: list, logits: mx.array, sampler: Callable, n: int) -> Iterator[int]:
    """Sample from `logits`, then keep feeding each sampled token back; yields n token ids.

    The next step is queued (async_eval) before the current token is handed out.
    """
    def sample(lg):
        return sampler(lg - mx.logsumexp(lg, axis=-1, keepdims=True))

    y = sample(logits)
    mx.async_eval(y)
    for i in range(n):
        nxt = None
        if i + 1 < n:
            nxt = sample(forward(model, y[:, None], caches)[:, -1, :])
            mx.async_eval(nxt)
        yield int(y.item())
        y = nxt


def generate_one(
    model: nn.Module,
    tokenizer,
    request: Request,
    caches: list,
    config: GenerateConfig = GenerateConfig(),
    on_text: Callable[[str], None] | None = None,
) -> Completion:
    """Generate one completion into `caches`; `on_text` receives text as it becomes final."""
    out = Completion(request.id, prompt_tokens=len(request.prompt_ids))
    matcher = StopMatcher(request.stop)
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
    detok = tokenizer.detokenizer
    detok.reset()
    shown = 0
    t0 = time.perf_counter()
    logits = prefill(model, list(request.prompt_ids), caches, config.prefill_chunk)
    mx.eval(logits)
    out.prompt_time = time.perf_counter() - t0
    t1 = time.perf_counter()
    for tok in decode_tokens(model, caches, logits, config.sampling.sampler(), request.max_tokens):
        if tok in eos:
            out.finish_reason, out.eos_token = "eos", tok
            break
        out.token_ids.append(tok)
        detok.add_token(tok)
        text = detok.text
        cut = matcher.find(text)
        if cut is not None:
            out.text, out.finish_reason = text[:cut], "stop"
            break
        safe = matcher.safe_length(text)
        if on_text and safe > shown:
            on_text(text[shown:safe])
            shown = safe
    out.gen_time = time.perf_counter() - t1
    if out.finish_reason is None:
        out.finish_reason = "length"
    if out.finish_reason != "stop":
        detok.finalize()
        out.text = detok.text
    if on_text and len(out.text) > shown:
        on_text(out.text[shown:])
    return out
