"""Where prompts come from (argument, -p, --prompt-file, --prompts-file, stdin)."""

from __future__ import annotations

import sys
from pathlib import Path

from kvcore.engine.prompts_file import PromptSpec, load_prompts_file
from kvcore.errors import MlxkvError


def _read_file(path: Path) -> str:
    if str(path) == "-":
        return sys.stdin.read()
    if not path.is_file():
        raise MlxkvError(f"prompt file not found: {path}")
    try:
        return path.read_text()
    except UnicodeDecodeError:
        raise MlxkvError(f"prompt file is not UTF-8 text: {path}")


def read_prompts(argument: str | None, prompts: list[str] | None, prompt_file: Path | None,
                 prompts_file: Path | None) -> list[PromptSpec]:
    given = [x for x in (argument, prompts or None, prompt_file, prompts_file) if x is not None]
    if len(given) > 1:
        raise MlxkvError("give the prompt once: as an argument, with -p, --prompt-file or --prompts-file")
    if prompts_file is not None:
        return load_prompts_file(prompts_file)
    if prompt_file is not None:
        return [PromptSpec(_read_file(prompt_file), "0")]
    texts = [argument] if argument is not None else list(prompts or [])
    if not texts:
        raise MlxkvError("no prompt: pass it as an argument, with -p, --prompt-file, or '-' for stdin")
    return [PromptSpec(sys.stdin.read() if t == "-" else t, str(i)) for i, t in enumerate(texts)]
