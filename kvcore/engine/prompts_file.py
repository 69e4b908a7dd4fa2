"""--prompts-file: JSON Lines (`{"prompt": ..., "max_tokens": ..., "id": ..., "adapter": DIR}`) or plain text
(one prompt a line). Validated whole before anything is generated. A row without an id gets its
position among the prompts, from 0, as `-p` rows do (blank lines are skipped, not counted)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..adapters import check_adapter_folder
from ..errors import MlxkvError


@dataclass(frozen=True)
class PromptSpec:
    prompt: str
    id: str
    max_tokens: int | None = None  # None: the run's --max-tokens
    adapter: str | None = None  # a LoRA adapter folder for this row (None: the run's --adapter-path)


def _from_json(path: Path, n: int, line: str, index: int) -> PromptSpec:
    where = f"prompts file {path.name} line {n}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise MlxkvError(f"{where}: not valid JSON ({e.msg})")
    except RecursionError:
        raise MlxkvError(f"{where}: nested too deeply to read") from None
    if not isinstance(obj, dict):
        raise MlxkvError(f"{where}: expected a JSON object")
    unknown = set(obj) - {"prompt", "max_tokens", "id", "adapter"}
    if unknown:
        raise MlxkvError(f"{where}: unknown key {sorted(unknown)[0]!r}")
    if not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
        raise MlxkvError(f"{where}: missing or empty \"prompt\" (a string)")
    mt = obj.get("max_tokens")
    if mt is not None and (isinstance(mt, bool) or not isinstance(mt, int) or mt < 0):
        raise MlxkvError(f"{where}: max_tokens must be a non-negative integer, got {mt!r}")
    rid = obj.get("id", str(index))
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        raise MlxkvError(f"{where}: id must be a string or integer")
    adapter = obj.get("adapter")
    if adapter is not None and (not isinstance(adapter, str) or not adapter):
        raise MlxkvError(f"{where}: adapter must be a folder name (a string)")
    return PromptSpec(obj["prompt"], str(rid), mt, adapter)


def load_prompts_file(path: str | Path) -> list[PromptSpec]:
    path = Path(path)
    if not path.is_file():
        raise MlxkvError(f"prompts file not found: {path}")
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()  # a byte-order mark is not part of line 1
    except UnicodeDecodeError:
        raise MlxkvError(f"prompts file is not UTF-8 text: {path}")
    except OSError as e:
        raise MlxkvError(f"prompts file {path}: cannot read it ({e.strerror or e})") from None
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    if not numbered:
        raise MlxkvError(f"prompts file {path.name} has no prompts")
    as_json = numbered[0][1].lstrip().startswith("{")
    # ids: a row's own "id", else its position among the prompts from 0 (as -p rows); errors name file lines
    specs = [_from_json(path, n, line, k) if as_json else PromptSpec(line, str(k)) for k, (n, line) in enumerate(numbered)]
    first: dict[str, int] = {}  # id -> its line (one pass: a million lines take seconds)
    for (n, _), spec in zip(numbered, specs):
        if spec.id in first:
            raise MlxkvError(f"prompts file {path.name}: id {spec.id!r} appears more than once (lines "
                             f"{first[spec.id]} and {n})")
        first[spec.id] = n
    for folder, n in {s.adapter: n for (n, _), s in reversed(list(zip(numbered, specs))) if s.adapter}.items():
        check_adapter_folder(folder, f"prompts file {path.name} line {n}: adapter")  # once per folder
    return specs
