"""Tool calling (OpenAI's `tools`): the tools go to the model's chat template (prompting.py); the
output's tool-call blocks, in the style of Qwen's and Hermes' templates,

```
<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris"}}
</tool_call>
```
are parsed into `tool_calls` (the text outside them stays `content`; output whose blocks are not
such JSON is content, unparsed). `tool_choice` "required" or a named function constrains the
output to one such block (a Lark grammar whose JSON part is the functions' parameter schemas,
through llguidance); "none" renders no tools and parses nothing.
"""

from __future__ import annotations

import json
import re
import uuid

from ..engine.constrain import ConstraintSpec
from ..errors import MlxkvError
from .errors import APIError, bad_request

OPEN, CLOSE = "<tool_call>", "</tool_call>"
BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)


def active(body) -> bool:
    """Tools are rendered and parsed (tools given, tool_choice not "none")."""
    return bool(getattr(body, "tools", None)) and body.tool_choice != "none"


def template_tools(body) -> list[dict] | None:
    return [t.model_dump(exclude_none=True) for t in body.tools] if active(body) else None


def parse(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a generated text; no calls: (text, [])."""
    calls = []
    for m in BLOCK.finditer(text):
        try:
            call = json.loads(m.group(1))
        except (json.JSONDecodeError, RecursionError):
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        args = call.get("arguments", call.get("parameters", {}))
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}})
    if not calls:
        return text, []
    rest = BLOCK.sub("", text).strip()
    return rest or None, calls


class ToolStream:
    """One choice's streamed text with tools on: content passes until a block may begin (a
    possible start of `<tool_call>` is held back); from a block on, the text is held and parsed
    at the end."""

    def __init__(self):
        self.held, self.inside = "", False

    def feed(self, text: str) -> str:
        """The content that can be sent now."""
        self.held += text
        if self.inside:
            return ""
        at = self.held.find(OPEN)
        if at >= 0:
            out, self.held, self.inside = self.held[:at], self.held[at:], True
            return out
        keep = next((k for k in range(min(len(OPEN) - 1, len(self.held)), 0, -1) if self.held.endswith(OPEN[:k])), 0)
        cut = len(self.held) - keep
        out, self.held = self.held[:cut], self.held[cut:]
        return out

    def end(self) -> tuple[str, list[dict]]:
        """(content still to send, tool_calls) once the choice is done."""
        content, calls = parse(self.held)
        self.held = ""
        return content or "", calls


def check_choice(body) -> None:
    """tool_choice needs tools; a named function must be one of them; a forced call is not combined
    with response_format."""
    choice = body.tool_choice
    if choice is None:
        return
    if not body.tools and choice not in ("none", "auto"):  # those two mean nothing without tools: let them be
        raise bad_request("'tool_choice' forcing a call needs 'tools'", "tool_choice")
    if not isinstance(choice, str):
        names = [t.function.name for t in body.tools or []]
        if choice.function.name not in names:
            raise bad_request(f"'tool_choice': no tool named {choice.function.name!r} in 'tools'", "tool_choice")
    if forced(body) and (body.response_format or {}).get("type", "text") != "text":
        raise bad_request("'tool_choice' that forces a call cannot be combined with 'response_format'", "tool_choice")


def forced(body) -> list | None:
    """The tools one of which the output must call ("required" or a named function), else None."""
    choice = getattr(body, "tool_choice", None)
    if not body.tools or choice in (None, "none", "auto"):
        return None
    return list(body.tools) if choice == "required" else [t for t in body.tools if t.function.name == choice.function.name]


def constraint(tools: list) -> ConstraintSpec:
    """One tool-call block calling one of `tools` with arguments their parameters schema allows."""
    def at(i: int) -> str:  # where tool i's parameters sit in the combined schema (its "#" refs move there)
        return ("" if len(tools) == 1 else f"/anyOf/{i}") + "/properties/arguments"

    calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                               "arguments": _rebase(t.function.parameters or {"type": "object"}, at(i))},
              "required": ["name", "arguments"], "additionalProperties": False} for i, t in enumerate(tools)]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    grammar = f'start: {json.dumps(OPEN + chr(10))} call {json.dumps(chr(10) + CLOSE)}\ncall: %json {json.dumps(schema)}\n'
    try:
        return ConstraintSpec("grammar", grammar)
    except MlxkvError as e:
        raise bad_request(f"'tools': {e}", "tools") from None


def _rebase(schema, pointer: str):
    """The schema with its local refs ("#", "#/$defs/X") pointing into `pointer`, where it now sits."""
    if isinstance(schema, list):
        return [_rebase(s, pointer) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _rebase(v, pointer) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = "#" + pointer + ref[1:]
    return out


def compile_error(message: str) -> APIError:
    """The engine's "--grammar does not compile: ..." for a forced call, as a 400 naming `tools`."""
    why = message.partition(" does not compile: ")[2] or message
    why = re.sub(r"^at \d+\(\d+\): ", "", why).split(" 1 | ")[0].strip()  # not the whole grammar echoed
    return bad_request(f"'tools': a function's parameters schema does not compile: {why}", "tools", "invalid_value")
