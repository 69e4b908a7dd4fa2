"""Typed reads from a JSON object that came from a file: each bad field is one error line."""

from __future__ import annotations

from typing import Callable

from .safetensors import is_int

Fail = Callable[[str], Exception]


class Fields:
    """`Fields(obj, "layer 3", fail).int("offset")`: the value, or `fail` raised naming it."""

    def __init__(self, obj, where: str, fail: Fail):
        self.where, self.fail = where, fail
        if not isinstance(obj, dict):
            raise fail(f"{where}: expected an object")
        self.obj = obj

    def _bad(self, key: str, expected: str) -> Exception:
        return self.fail(f"{self.where}: {key!r} must be {expected}, got {self.obj.get(key, 'nothing')!r}")

    def get(self, key: str):
        if key not in self.obj:
            raise self.fail(f"{self.where}: missing {key!r}")
        return self.obj[key]

    def int(self, key: str, lo: int = 0, hi: int | None = None, optional: bool = False) -> int | None:
        v = self.get(key)
        if v is None and optional:
            return None
        if not is_int(v) or v < lo or (hi is not None and v > hi):
            raise self._bad(key, f"an integer >= {lo}" + (f" and <= {hi}" if hi is not None else ""))
        return v

    def bool(self, key: str) -> bool:
        v = self.get(key)
        if not isinstance(v, bool):
            raise self._bad(key, "true or false")
        return v

    def str(self, key: str, choices: tuple[str, ...] | None = None) -> str:
        v = self.get(key)
        if not isinstance(v, str) or (choices is not None and v not in choices):
            raise self._bad(key, f"one of {list(choices)}" if choices else "a string")
        return v

    def ints(self, key: str, n: int, lo: int = 0, hi: int | None = None, optional: bool = False):
        v = self.get(key)
        if v is None and optional:
            return None
        if (not isinstance(v, list) or len(v) != n
                or not all(is_int(x) and x >= lo and (hi is None or x <= hi) for x in v)):
            raise self._bad(key, f"a list of {n} integers >= {lo}")
        return v

    def sub(self, key: str) -> "Fields":
        return Fields(self.get(key), f"{self.where}.{key}", self.fail)
