"""A request and all of its state while it is generated: the only code that finishes a token.

```
WAITING --admit--> PREFILLING --last prompt chunk--> RUNNING --EOS/stop/length/abort--> FINISHED
```
`Sequence.append` takes each sampled token and decides, in one place, whether it ends the
row (EOS, a stop string, the length limit); it returns the TokenEvent a caller streams.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import mlx.core as mx

from .sampling import SamplingConfig, unpack_logprobs
from .stops import StopMatcher


@dataclass(frozen=True)
class Request:
    prompt_ids: tuple[int, ...]
    max_tokens: int = 256
    id: str = "0"
    stop: tuple[str, ...] = ()
    sampling: SamplingConfig | None = None  # this row's sampling (None: the engine's)
    adapter: str | None = None  # this row's LoRA adapter folder (kvcore/adapter_set.py; None: the run's)


@dataclass
class Completion:
    id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "eos" | "stop" | "length" | "abort"
    prompt_tokens: int = 0
    prompt_time: float = 0.0
    gen_time: float = 0.0
    eos_token: int | None = None  # the EOS that ended it (fed to the caches, not in token_ids)
    logprobs: list[dict] | None = None  # per token in token_ids: {"logprob", "top": [[id, lp], ...]}

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
            **({"logprobs": self.logprobs} if self.logprobs is not None else {}),
        }


@dataclass(frozen=True)
class TokenEvent:
    """One step of one row: the token (None when the row ended without one), the text that became
    final with it, and the finish reason once the row is done."""

    id: str
    token: int | None
    text: str = ""
    finish_reason: str | None = None


class Status(Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request: Request, tokenizer=None, sampling: SamplingConfig | None = None):
        self.request = request
        self.sampling = request.sampling or sampling or SamplingConfig()
        self.out = Completion(request.id, prompt_tokens=len(request.prompt_ids))
        self.eos = set(getattr(tokenizer, "eos_token_ids", None) or []) if tokenizer is not None else set()
        self.detok = tokenizer.detokenizer if tokenizer is not None else None
        if self.detok is not None:
            self.detok.reset()
        self.matcher = StopMatcher(request.stop)
        self.status = Status.WAITING
        self.caches: list | None = None  # its own caches while it is prefilled alone
        self.done_prompt = 0  # prompt tokens fed so far
        self.reserved = 0  # KV bytes the scheduler reserved for it
        self.prefill_limit: int | None = None  # MLX memory limit while its prompt is prefilled (0: none)
        self.next_token: int | None = None  # the last token, to be fed next
        self.key = mx.random.key(request.sampling.seed) if request.sampling and request.sampling.seed is not None else None
        if self.sampling.logprobs is not None:
            self.out.logprobs = []
        self.history: mx.array | None = None  # the last tokens the repetition penalty sees (lazy)
        self.counts: mx.array | None = None  # (V,) generated tokens' counts, for presence/frequency (lazy)
        self.constraint = None  # its token mask's matcher (constrain.py)
        if self.sampling.constraint is not None:
            from .constrain import Constraint

            self.constraint = Constraint(self.sampling.constraint, tokenizer)
        if self.sampling.penalized:
            self.history = mx.array(list(request.prompt_ids[-self.sampling.repetition_context_size:]), mx.int32)
        self._shown = 0  # characters of text already handed out in events
        self.t_start = time.perf_counter()
        self.t_decode = 0.0

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def finished(self) -> bool:
        return self.out.finish_reason is not None

    @property
    def context(self) -> list[int]:
        """Every token fed or to be fed: the prompt and the generated tokens."""
        return list(self.request.prompt_ids) + self.out.token_ids

    @property
    def remaining(self) -> int:
        return self.request.max_tokens - len(self.out.token_ids)

    def started(self) -> None:
        """The prompt is in: decoding begins (time to first token ends here)."""
        self.out.prompt_time = time.perf_counter() - self.t_start
        self.t_decode = time.perf_counter()
        self.status = Status.RUNNING
        if self.request.max_tokens == 0:
            self.finish("length")

    def remember(self, tok: mx.array) -> None:
        """A sampled token (1,), still lazy, joins the repetition penalty's history and the counts."""
        if self.sampling.penalized:
            hist = tok.astype(mx.int32) if self.history is None else mx.concatenate([self.history, tok.astype(mx.int32)])
            self.history = hist[-self.sampling.repetition_context_size:]
        if self.counts is not None:
            self.counts = self.counts.at[tok].add(1.0)

    def take(self, sampled) -> TokenEvent:
        """A read-back sampled value: a token id, or a packed row with its logprobs (sampling.py)."""
        if isinstance(sampled, list):
            return self.append(*unpack_logprobs(sampled, self.sampling.logprobs))
        return self.append(sampled)

    def append(self, tok: int, logprob: dict | None = None) -> TokenEvent:
        """Take one sampled token: EOS, a stop string or the length limit may end the row."""
        if tok in self.eos:
            self.out.eos_token = tok
            return self.finish("eos")
        self.out.token_ids.append(tok)
        if self.constraint is not None:
            self.constraint.consume(tok)
        if self.out.logprobs is not None:
            self.out.logprobs.append(logprob)
        self.next_token = tok
        if self.detok is not None:
            self.detok.add_token(tok)
            text = self.detok.text
            cut = self.matcher.find(text)
            if cut is not None:
                self.out.text = text[:cut]
                return self.finish("stop", tok)
        if len(self.out.token_ids) >= self.request.max_tokens:
            return self.finish("length", tok)
        return TokenEvent(self.id, tok, self._new_text(final=False))

    def finish(self, reason: str, tok: int | None = None) -> TokenEvent:
        if self.finished:
            return TokenEvent(self.id, None, "", self.out.finish_reason)
        self.out.finish_reason = reason
        self.out.gen_time = time.perf_counter() - self.t_decode if self.t_decode else 0.0
        if reason != "stop" and self.detok is not None:
            self.detok.finalize()
            self.out.text = self.detok.text
        self.status = Status.FINISHED
        return TokenEvent(self.id, tok, self._new_text(final=True), reason)

    def _new_text(self, final: bool) -> str:
        if self.detok is None:
            return ""
        text = self.out.text if final else self.detok.text
        safe = len(text) if final else self.matcher.safe_length(text)
        if safe <= self._shown:
            return ""
        new, self._shown = text[self._shown : safe], safe
        return new
