"""The OpenAI request bodies the server takes, validated strictly (wrong types, unknown fields,
out-of-range values are 400s naming the field), and the response objects it returns."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from .errors import bad_request

Stop = Optional[Union[str, list[str]]]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict]] = None
    tool_call_id: Optional[str] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields both endpoints share."""

    model: str
    max_tokens: Optional[int] = Field(None, ge=0)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    n: Optional[int] = Field(None, ge=1, le=128)
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Stop = None
    seed: Optional[int] = Field(None, ge=0, lt=2**63)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    # common extensions (vLLM, mlx_lm.server)
    top_k: Optional[int] = Field(None, ge=0)
    min_p: Optional[float] = Field(None, ge=0, lt=1)
    repetition_penalty: Optional[float] = Field(None, gt=0)

    def stops(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > 4:
            raise bad_request("'stop' takes at most 4 sequences", "stop")
        return tuple(s for s in stop if s)


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=0)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    response_format: Optional[dict] = None
    tools: Optional[list[Tool]] = Field(None, max_length=128)
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int]]
    echo: Optional[bool] = None
    logprobs: Optional[int] = Field(None, ge=0, le=5)
    suffix: Optional[str] = None
    best_of: Optional[int] = Field(None, ge=1)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


FINISH = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}


def usage(prompt: int, completion: int, cached: int = 0) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def response(obj: str, rid: str, model: str, choices: list[dict], use: dict) -> dict:
    """A whole answer: `obj` "chat.completion" or "text_completion"."""
    return {"id": rid, "object": obj, "created": now(), "model": model, "choices": choices, "usage": use}


def chunk(obj: str, rid: str, model: str, created: int, choice: dict | None = None, use: dict | None = None) -> dict:
    """One server-sent event: a choice's delta, or (with `use`) the final usage chunk (no choices)."""
    out: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model,
                           "choices": [] if choice is None else [choice]}
    if use is not None:
        out["usage"] = use
    return out


def finish(reason: str | None) -> str | None:
    return FINISH.get(reason, reason) if reason else None
