"""Where prompts come from (argument, -p, --prompt-file, stdin) and how they become token ids."""

from __future__ import annotations

import sys
from pathlib import Path

from kvcore.errors import MlxkvError


def read_prompt(argument: str | None, prompt: str | None, prompt_file: Path | None) -> str:
    given = [x for x in (argument, prompt, prompt_file) if x is not None]
    if len(given) > 1:
        raise MlxkvError("give the prompt once: as an argument, with -p, or with --prompt-file")
    if prompt_file is not None:
        if str(prompt_file) == "-":
            return sys.stdin.read()
        if not prompt_file.is_file():
            raise MlxkvError(f"prompt file not found: {prompt_file}")
        try:
            return prompt_file.read_text()
        except UnicodeDecodeError:
            raise MlxkvError(f"prompt file is not UTF-8 text: {prompt_file}")
    text = argument if argument is not None else prompt
    if text == "-":
        return sys.stdin.read()
    if text is None:
        raise MlxkvError("no prompt: pass it as an argument, with -p, --prompt-file, or '-' for stdin")
    return text
