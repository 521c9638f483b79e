"""Stop sequences over streamed text (OpenAI `stop`): never emit the stop itself.

Why hold text back: tokens arrive a few characters at a time, and a stop
string may straddle two tokens. Text that could still turn out to be the start
of a stop string is kept until the next token settles it, so a client never
receives half of a stop sequence it asked not to see.
"""

from __future__ import annotations


class StopMatcher:
    """Feed text deltas; get back what may be shown now, and whether a stop hit."""

    __slots__ = ("stops", "pending", "hit")

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.hit = ""  # the stop that ended the text (Anthropic's stop_sequence)

    def feed(self, delta: str) -> tuple[str, bool]:
        """Return (text safe to emit, stopped). After a stop, nothing more is emitted."""
        buf = self.pending + delta
        cut = -1
        for stop in self.stops:
            index = buf.find(stop)
            if index != -1 and (cut == -1 or index < cut):
                cut, self.hit = index, stop
        if cut != -1:
            self.pending = ""
            return buf[:cut], True
        hold = self._held_suffix(buf)
        self.pending = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """The held-back text, released because generation ended without a stop."""
        text, self.pending = self.pending, ""
        return text

    def _held_suffix(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best
