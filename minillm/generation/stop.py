"""Stop strings over a token stream.

A stop string can span several tokens ("<|end" + "|>"), so streamed text is released only once it
can no longer be the beginning of a stop string. When a stop string appears, everything from its
first character on is dropped: stop strings never reach the caller.
"""
from __future__ import annotations

from collections.abc import Sequence


class StopStringFilter:
    """Holds back the tail of the stream that might still grow into a stop string."""

    def __init__(self, stops: Sequence[str] = ()):
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = tuple(stops)
        self.pending = ""
        self.matched: str | None = None  # the stop string that ended the stream

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def push(self, piece: str) -> str:
        """Add newly decoded text; return the text that is now safe to show."""
        if self.stopped:
            return ""
        self.pending += piece
        hits = [(i, s) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if hits:
            first, self.matched = min(hits)
            released, self.pending = self.pending[:first], ""
            return released
        hold = self._longest_stop_prefix_at_end()
        released = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold:]
        return released

    def flush(self) -> str:
        """The stream ended without a stop string: the held-back tail is ordinary text."""
        released, self.pending = ("" if self.stopped else self.pending), ""
        return released

    def _longest_stop_prefix_at_end(self) -> int:
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.pending)), longest, -1):
                if self.pending.endswith(stop[:k]):
                    longest = k
                    break
        return longest
