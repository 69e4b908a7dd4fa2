"""One-line exception text for error cells and verdicts: an empty message names the exception's type instead of
raising IndexError from `str(e).splitlines()[0]` (the bench's error cells did)."""

from __future__ import annotations

from kvcore.backend import failure
from kvcore.errors import first_line


def test_first_line_of_messages_empty_long_and_multiline():
    assert first_line(RuntimeError()) == "RuntimeError" and first_line(RuntimeError("")) == "RuntimeError"
    assert first_line(ValueError("bad\nsecond")) == "bad" and first_line(ValueError("\nx")) == "ValueError"
    assert first_line(KeyError("k" * 500), limit=10) == "'kkkkkkkkk"


def test_a_failure_line_names_the_type_once():
    assert failure(RuntimeError()) == "RuntimeError"
    assert failure(MemoryError("out of memory\n  at ...")) == "MemoryError: out of memory"
