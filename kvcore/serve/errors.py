"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

from __future__ import annotations


class APIError(Exception):
    """A request the server refuses: its status, one-line message, and the field it names."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def to_json(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def from_validation(errors: list[dict]) -> APIError:
    """pydantic's errors -> one 400 naming the first bad field (OpenAI names one at a time)."""
    e = errors[0]
    loc = [str(p) for p in e.get("loc", ())]
    if e.get("type") == "json_invalid":
        return bad_request(f"the request body is not valid JSON ({e.get('ctx', {}).get('error', e['msg'])})",
                           code="invalid_json")
    param = _dotted(loc)
    if not param:
        return bad_request("the request body must be a JSON object", code="invalid_type")
    if e.get("type") == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
    if e.get("type") == "missing":
        return bad_request(f"Missing required parameter: '{param}'", param, "missing_required_parameter")
    return bad_request(f"Invalid value for '{param}': {e['msg']}", param, "invalid_value")


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}  # pydantic's union branches


def _dotted(loc: list[str]) -> str:
    """("messages", "0", "content") -> "messages[0].content"; union branch names are dropped."""
    out = ""
    for p in loc:
        if p.isdigit():
            out += f"[{p}]"
        elif p.isidentifier() and p not in _TYPE_TAGS:
            out += ("." if out else "") + p
    return out
