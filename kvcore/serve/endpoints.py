"""What differs between the two completion routes, as data: one `Endpoint` each (its body, ids and
object names, how its prompt is encoded, a whole answer's choice, and a streamed choice's
deltas); app.py has one handler for both.

```
CHAT   /v1/chat/completions  messages (+ tools) -> chat template  choice.message {role, content[, tool_calls]}
TEXT   /v1/completions       prompt (text or ids)       choice.text
```
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..engine import Completion
from . import protocol as P
from . import tools
from .logprobs import chat_logprobs, completion_logprobs
from .prompting import chat_ids, completion_ids
from .served import Served


class TextStream:
    """A text completion's streamed deltas: each piece of text, then the finish reason."""

    def __init__(self, body, n: int):
        pass

    def start(self, i: int) -> list[dict]:
        return []

    def text(self, i: int, text: str) -> list[dict]:
        return [{"index": i, "text": text, "logprobs": None, "finish_reason": None}]

    def end(self, i: int, reason: str) -> list[dict]:
        return [{"index": i, "text": "", "logprobs": None, "finish_reason": P.finish(reason)}]


class ChatStream(TextStream):
    """A chat completion's streamed deltas: the role first, then content, then the finish reason.
    With tools, a tool-call block is held back and sent parsed, as `tool_calls`, at the end."""

    def __init__(self, body, n: int):
        self.tools = [tools.ToolStream() for _ in range(n)] if tools.active(body) else None

    def start(self, i: int) -> list[dict]:
        return [_chat_delta(i, {"role": "assistant", "content": ""})]

    def text(self, i: int, text: str) -> list[dict]:
        if self.tools is not None:
            text = self.tools[i].feed(text)
        return [_chat_delta(i, {"content": text})] if text else []

    def end(self, i: int, reason: str) -> list[dict]:
        rest, calls = self.tools[i].end() if self.tools is not None else ("", [])
        out = [_chat_delta(i, {"content": rest})] if rest else []
        if calls:
            out.append(_chat_delta(i, {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}))
            reason = "tool_calls"
        return out + [_chat_delta(i, {}, reason)]


def _chat_delta(i: int, delta: dict, reason: str | None = None) -> dict:
    return {"index": i, "delta": delta, "logprobs": None, "finish_reason": P.finish(reason)}


def _chat_choice(served: Served, body, i: int, c: Completion) -> dict:
    lp = None if c.logprobs is None else chat_logprobs(served.tokenizer, c.token_ids, c.logprobs)
    content, calls = tools.parse(c.text) if tools.active(body) else (c.text, [])
    message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
    return {"index": i, "message": message, "logprobs": lp,
            "finish_reason": "tool_calls" if calls else P.finish(c.finish_reason)}


def _text_choice(served: Served, body, i: int, c: Completion) -> dict:
    lp = None if c.logprobs is None else completion_logprobs(served.tokenizer, c.token_ids, c.logprobs)
    return {"index": i, "text": c.text, "logprobs": lp, "finish_reason": P.finish(c.finish_reason)}


@dataclass(frozen=True)
class Endpoint:
    body: type  # the request model (protocol.py)
    id_prefix: str
    obj: str  # a whole answer's object
    chunk_obj: str  # a streamed chunk's object
    prompt: Callable[[Served, Any], list[int]]
    choice: Callable[[Served, Any, int, Completion], dict]
    stream: type  # (body, n) -> start / text / end deltas per choice


CHAT = Endpoint(P.ChatRequest, "chatcmpl", "chat.completion", "chat.completion.chunk",
                lambda served, body: chat_ids(served.tokenizer, body.messages, tools.template_tools(body)),
                _chat_choice, ChatStream)
TEXT = Endpoint(P.CompletionRequest, "cmpl", "text_completion", "text_completion",
                lambda served, body: completion_ids(served.tokenizer, body.prompt, served.vocab), _text_choice,
                TextStream)
