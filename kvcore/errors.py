from __future__ import annotations


class MlxkvError(Exception):
    """A user-facing error: one line, no traceback, exit code 1."""


def first_line(e: BaseException, limit: int | None = 200, empty: str | None = None) -> str:
    """An exception's message as one line: its first line (at most `limit` characters; None: all of it), or
    `empty` (default: its type's name) when that line is empty (`str(e).splitlines()[0]` raises IndexError there)."""
    lines = str(e).splitlines()
    if lines and lines[0]:
        return lines[0][:limit]
    return type(e).__name__ if empty is None else empty
