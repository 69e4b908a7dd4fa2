"""Request text -> prompt token ids: chat messages through the model's chat template (as
`mlxkv generate` encodes a prompt), completion prompts as raw text or token ids."""

from __future__ import annotations

from ..engine.prompt import has_chat_template
from .errors import bad_request
from .protocol import Message


def chat_ids(tokenizer, messages: list[Message]) -> list[int]:
    """With a chat template: its rendering plus the generation prompt. Without one: the
    messages' texts joined by blank lines (one user message, with or without a system message,
    encodes exactly as `mlxkv generate -p TEXT [--system-prompt S]` does)."""
    if has_chat_template(tokenizer):
        turns = [_turn(m) for m in messages]
        try:
            text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # the template's own checks (e.g. roles must alternate)
            raise bad_request(f"the model's chat template refused these messages: {e}", "messages") from None
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode("\n\n".join(m.text() for m in messages)))


def _turn(m: Message) -> dict:
    turn = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    for key in ("name", "tool_calls", "tool_call_id"):
        if getattr(m, key) is not None:
            turn[key] = getattr(m, key)
    return turn


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
