class MlxkvError(Exception):
    """A user-facing error: one line, no traceback, exit code 1."""
