"""Multi-turn chat rendering: the whole conversation through the tokenizer's chat template.

A conversation continued from caches is never built by gluing a rendered turn onto the cached
tokens (that breaks templates whose first turn differs: a default system prompt, a BOS, a
newline after the end-of-turn token, an assistant turn cut by the length limit, or templates
that rewrite history, as Qwen3 drops old `<think>` blocks). Instead the WHOLE conversation is
rendered at once, and the caches keep their longest common prefix with it (engine/reuse.py):

```
cached:   <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>
rendered: <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n...
          '--------------------- kept (common prefix) ------------------------''-- prefilled --'
```
so the tokens the model has seen always equal the conversation rendered at once.

The messages live beside a cache file in `FILE.chat.json` (a conversation file, tied to the
cache's token ids by a digest). A cache saved without one is continued by `turn_delta`: the
template's text for "close the last answer, then a new user turn", measured on a dummy
conversation.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..errors import MlxkvError, first_line
from .prompt import has_chat_template

FORMAT, VERSION = "mlxkv-chat", 1
ROLES = ("system", "user", "assistant")
_MARK = "mlxkv\u2063answer"  # dummy content, unlikely in any template


def conversation(messages: list[dict], system: str | None = None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + list(messages)


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """The conversation's token ids, as the chat template renders it at once."""
    if not has_chat_template(tokenizer):
        raise MlxkvError("this model's tokenizer has no chat template: chat needs one (use generate)")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja errors: a template that refuses this conversation
        raise MlxkvError(f"the chat template cannot render this conversation: {first_line(e, None)}") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


def _text(tokenizer, messages, gen: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)


def turn_delta(tokenizer, prefix_ids: list[int], text: str) -> list[int] | None:
    """Tokens that close the cached answer and open a new user turn `text`, when no conversation
    is known; None when the template is not prefix-stable on a dummy conversation."""
    q = {"role": "user", "content": "mlxkv question"}
    a = {"role": "assistant", "content": _MARK}
    before = _text(tokenizer, [q, a], False)
    after = _text(tokenizer, [q, a, {"role": "user", "content": text}], True)
    if not after.startswith(before) or _MARK not in before:
        return None
    close = before.split(_MARK)[-1]  # what the template writes after an answer, e.g. "<|im_end|>\n"
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
    if prefix_ids and prefix_ids[-1] in eos:
        end = tokenizer.convert_ids_to_tokens(prefix_ids[-1]) if hasattr(tokenizer, "convert_ids_to_tokens") else ""
        if end and close.startswith(end):
            close = close[len(end):]  # the answer's end token is in the cache already
    return list(tokenizer.encode(close + after[len(before):], add_special_tokens=False))


# -- the conversation file beside a cache file ----------------------------------------
def conversation_path(cache_path: str | Path) -> Path:
    return Path(str(cache_path) + ".chat.json")


def _digest(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()


def check_messages(messages, where: str) -> list[dict]:
    if not isinstance(messages, list):
        raise MlxkvError(f"{where}: 'messages' must be a list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise MlxkvError(f"{where}: message {i} must be {{\"role\": one of {', '.join(ROLES)}, "
                             "\"content\": text}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def save_conversation(cache_path: str | Path, messages: list[dict], cached_ids: list[int]) -> Path:
    """Write the conversation a cache file holds (atomically), tied to its token ids."""
    from ..store.atomic import atomic_write

    path = conversation_path(cache_path)
    doc = {"format": FORMAT, "version": VERSION, "messages": check_messages(messages, str(path)),
           "prefix_sha256": _digest(cached_ids)}
    atomic_write(path, lambda f: f.write(json.dumps(doc, ensure_ascii=False, indent=1).encode()))
    return path


def load_conversation(cache_path: str | Path, cached_ids: list[int]) -> list[dict] | None:
    """The conversation saved beside a cache file, or None: there is none, or it belongs to other
    tokens (a later save of the cache without one)."""
    path = conversation_path(cache_path)
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise MlxkvError(f"conversation file {path} is not JSON ({type(e).__name__})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise MlxkvError(f"{path} is not an mlxkv conversation file")
    if doc.get("version") != VERSION:
        raise MlxkvError(f"{path}: conversation format version {doc.get('version')!r} is not supported")
    messages = check_messages(doc.get("messages"), str(path))
    return messages if doc.get("prefix_sha256") == _digest(cached_ids) else None


# -- continuing a saved cache as a chat ---------------------------------------------------
def continue_chat(tokenizer, cache_path, prefix_ids: list[int], text: str, system: str | None = None,
                  use_file: bool = True) -> tuple[list[int], list[dict] | None]:
    """(the whole context for a new user turn `text` after a cache holding `prefix_ids`, the
    conversation it renders or None when unknown). With the conversation file beside the cache:
    the whole conversation rendered at once; without: the cached tokens, then `turn_delta`."""
    user = {"role": "user", "content": text}
    messages = load_conversation(cache_path, prefix_ids) if use_file else None
    if messages is not None:
        messages = messages + [user]
        return render(tokenizer, messages), messages
    if not has_chat_template(tokenizer):
        raise MlxkvError("--chat-continue needs a chat template; this model's tokenizer has none")
    delta = turn_delta(tokenizer, prefix_ids, text)
    if delta is None:  # not prefix-stable even on a dummy: the lone turn, its BOS dropped
        from .prompt import encode_continuation

        delta = encode_continuation(tokenizer, text, chat=True)
    return list(prefix_ids) + delta, None


def held_ids(context: list[int], completion, offset: int) -> list[int]:
    """The tokens caches hold after generating `completion` from `context` (`offset` of them):
    the generated ones fed back, the EOS that ended it included."""
    fed = list(context) + completion.token_ids + ([completion.eos_token] if completion.eos_token is not None else [])
    return fed[:offset]
