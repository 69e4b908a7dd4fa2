"""Where prompts come from (argument, -p, --prompt-file, --prompts-file, stdin)."""

from __future__ import annotations

import sys
from pathlib import Path

from kvcore.errors import MlxkvError


def read_stdin() -> str:
    """All of stdin as UTF-8 text (bytes that are not UTF-8 are a one-line error, not a crash later)."""
    stream = getattr(sys.stdin, "buffer", None)
    data = stream.read() if stream is not None else sys.stdin.read()
    if isinstance(data, str):
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MlxkvError(f"stdin is not UTF-8 text (byte {e.start} is {data[e.start]:#04x}; binary input?)") from None


def _read_file(path: Path) -> str:
    if str(path) == "-":
        return read_stdin()
    if not path.is_file():
        raise MlxkvError(f"prompt file not found: {path}")
    try:
        return path.read_text()
    except UnicodeDecodeError:
        raise MlxkvError(f"prompt file is not UTF-8 text: {path}")
    except OSError as e:
        raise MlxkvError(f"prompt file {path}: cannot read it ({e.strerror or e})") from None


def _not_empty(text: str, where: str) -> str:
    if not text.strip():
        raise MlxkvError(f"{where} is empty: nothing to generate from (give some text)")
    return text


def read_prompts(argument: str | None, prompts: list[str] | None, prompt_file: Path | None,
                 prompts_file: Path | None, continuation: bool = False) -> list[PromptSpec]:
    """The prompts, each non-empty; `continuation` (-p text after a loaded cache) may be empty: the
    run then continues the cached tokens."""
    from kvcore.engine.prompts_file import PromptSpec, load_prompts_file
    given = [x for x in (argument, prompts or None, prompt_file, prompts_file) if x is not None]
    if len(given) > 1:
        raise MlxkvError("give the prompt once: as an argument, with -p, --prompt-file or --prompts-file")
    if prompts_file is not None:
        return load_prompts_file(prompts_file)
    if prompt_file is not None:
        where = "stdin" if str(prompt_file) == "-" else f"prompt file {prompt_file}"
        return [PromptSpec(_not_empty(_read_file(prompt_file), where), "0")]
    texts = [argument] if argument is not None else list(prompts or [])
    if not texts:
        raise MlxkvError("no prompt: pass it as an argument, with -p, --prompt-file, or '-' for stdin")
    specs = []
    for i, t in enumerate(texts):
        text = read_stdin() if t == "-" else t
        where = "stdin" if t == "-" else "the prompt" if argument is not None else f"-p prompt {i}"
        specs.append(PromptSpec(text if continuation else _not_empty(text, where), str(i)))
    return specs
