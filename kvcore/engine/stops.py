"""Stop strings over streamed text: find the first stop and hold back possible prefixes."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...] = ()):
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1

    def find(self, text: str) -> int | None:
        """Index where the earliest stop string begins, if any."""
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def safe_length(self, text: str) -> int:
        """How much of `text` can be shown: none of it can begin a stop string."""
        return max(0, len(text) - self.hold) if self.stops else len(text)
