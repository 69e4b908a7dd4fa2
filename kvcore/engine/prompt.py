"""Prompt text -> token ids, with the tokenizer's chat template when it has one."""

from __future__ import annotations


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer, prompt: str, system: str | None = None, chat_template: bool = True) -> list[int]:
    if chat_template and has_chat_template(tokenizer):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer.encode(text, add_special_tokens=False))
    text = f"{system}\n\n{prompt}" if system else prompt
    return list(tokenizer.encode(text))


def encode_continuation(tokenizer, text: str, chat: bool = False) -> list[int]:
    """Tokens that follow an existing context: no BOS; with `chat`, the text as a new user turn
    (the chat template's rendering of it, minus a leading BOS)."""
    if chat and has_chat_template(tokenizer):
        s = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                          add_generation_prompt=True)
        bos = getattr(tokenizer, "bos_token", None)
        text = s[len(bos):] if bos and s.startswith(bos) else s
    return list(tokenizer.encode(text, add_special_tokens=False))
