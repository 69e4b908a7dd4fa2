"""Request text -> prompt token ids: chat messages through the model's chat template (as
`mlxkv generate` encodes a prompt), completion prompts as raw text or token ids."""

from __future__ import annotations

import json

from ..engine.prompt import has_chat_template
from .errors import bad_request
from .protocol import Message


def chat_ids(tokenizer, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
    """With a chat template: its rendering plus the generation prompt (and the tools, which the
    template must render). Without one: the messages' texts joined by blank lines (one user
    message, with or without a system message, encodes exactly as `mlxkv generate -p TEXT
    [--system-prompt S]` does)."""
    if has_chat_template(tokenizer):
        turns = [_turn(m) for m in messages]
        text = _render(tokenizer, turns, tools)
        if tools and text == _render(tokenizer, turns, None):
            raise bad_request("'tools': this model's chat template does not render tools", "tools")
        return list(tokenizer.encode(text, add_special_tokens=False))
    if tools:
        raise bad_request("'tools': this model has no chat template to render them with", "tools")
    return list(tokenizer.encode("\n\n".join(m.text() for m in messages)))


def _render(tokenizer, turns: list[dict], tools: list[dict] | None) -> str:
    extra = {"tools": tools} if tools else {}
    try:
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True, **extra)
    except Exception as e:  # the template's own checks (e.g. roles must alternate)
        raise bad_request(f"the model's chat template refused these messages: {e}", "messages") from None


def _turn(m: Message) -> dict:
    turn = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    for key in ("name", "tool_call_id"):
        if getattr(m, key) is not None:
            turn[key] = getattr(m, key)
    if m.tool_calls is not None:
        turn["tool_calls"] = [_call(c) for c in m.tool_calls]
    return turn


def _call(call: dict) -> dict:
    """An assistant's tool call as templates take it: OpenAI sends the arguments as JSON text,
    templates (Qwen's, Hermes') render them as an object."""
    fn = call.get("function")
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            return {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
        except (json.JSONDecodeError, RecursionError):
            pass
    return call


def completion_ids(tokenizer, prompt, vocab: int) -> list[int]:
    """A string is encoded as `mlxkv generate --no-chat-template` does; a list of ints is taken
    as token ids; a list of one string as that string."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) > 1:
            raise bad_request("'prompt': one prompt per request (a list of several is not supported yet)", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"'prompt': token id {bad} is outside the vocabulary (0..{vocab - 1})", "prompt")
    return list(prompt)
