"""Stop strings over a token stream.

A stop string can span several tokens ("<|end" + "|>"), so streamed text is released only once it
can no longer be the beginning of a stop string. When a stop string appears, everything from its
first character on is dropped: stop strings never reach the caller.

The filter runs once per generated token on the engine thread, where every other request waits for
it, so its work per token is bounded: at most ``MAX_STOP_STRINGS`` strings of at most
``MAX_STOP_LENGTH`` characters (``check_stop_strings``; the engine refuses a request beyond them),
and each new piece is matched incrementally - only the held-back tail (shorter than the longest
stop string) plus the new text is searched, never the whole completion.
"""
from __future__ import annotations

from collections.abc import Sequence

MAX_STOP_STRINGS = 16    # OpenAI takes 4; vLLM no limit. Enough for any template's end markers
MAX_STOP_LENGTH = 256    # characters per stop string


def check_stop_strings(stops: Sequence[str]) -> None:
    """Raise ValueError naming the limit a list of stop strings breaks."""
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"stop holds {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed")
    if too_long := [i for i, s in enumerate(stops) if len(s) > MAX_STOP_LENGTH]:
        raise ValueError(f"stop[{too_long[0]}] is {len(stops[too_long[0]])} characters long; stop strings may "
                         f"have at most {MAX_STOP_LENGTH}")


class StopStringFilter:
    """Holds back the tail of the stream that might still grow into a stop string."""

    def __init__(self, stops: Sequence[str] = ()):
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        check_stop_strings(stops)
        self.stops = tuple(stops)
        self.pending = ""  # held back: the end of the stream that is a prefix of some stop string
        self.matched: str | None = None  # the stop string that ended the stream

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def push(self, piece: str) -> str:
        """Add newly decoded text; return the text that is now safe to show."""
        if self.stopped:
            return ""
        # Everything before `pending` was released: it held no stop string and no stop string's
        # start, so a new match must begin inside pending + piece - the only text searched.
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
        """The length of the longest end of `pending` that begins some stop string (0: none)."""
        if not self.pending:
            return 0
        longest, last = 0, self.pending[-1]
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.pending)), longest, -1):
                if stop[k - 1] == last and self.pending.endswith(stop[:k]):
                    longest = k
                    break
        return longest
