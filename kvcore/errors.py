class MlxkvError(Exception):
    """A user-facing error: one line, no traceback, exit code 1."""


def first_line(e: BaseException, limit: int = 200) -> str:
    """An exception's message as one line: its first line (at most `limit` characters), or its type's name
    when the message is empty (`str(e).splitlines()[0]` raises IndexError there)."""
    lines = str(e).splitlines()
    return lines[0][:limit] if lines and lines[0] else type(e).__name__
