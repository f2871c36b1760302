"""Incremental detokenization for streamed completions: text deltas whose concatenation is exactly the decode
of all the generated ids, and that never end inside a UTF-8 character.

Decoding token by token is wrong twice over: a character split over byte-fallback tokens (``<0xE2>
<0x82> <0xAC>`` is ``€``) decodes to U+FFFD halves, and decoders that join pieces (leading spaces,
``clean_up_tokenization_spaces``) give a different text for the pieces than for the whole. So every step
decodes the whole sequence and emits what grew after the text already sent, holding back a trailing
U+FFFD (a character still incomplete) and trailing whitespace (a decoder may yet fold it into the next
piece), and at the end emits everything that is left. A ``stop`` string ends the text before it (the
OpenAI API leaves the stop sequence out): text that could still become a stop string is held back too.
"""

from __future__ import annotations

from typing import Callable, Sequence

__all__ = ["IncrementalDetokenizer", "cut_at_stop"]

_INCOMPLETE = "\ufffd"


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """``text`` up to (not including) the first stop string in it, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


class IncrementalDetokenizer:
    """Feed it every new token id list (:meth:`add`) and get the text to send now; :meth:`finish` gives
    the rest. ``decode(ids) -> str`` decodes a whole sequence (special tokens skipped)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()):
        self._decode = decode
        self._stop = tuple(s for s in stop if s)
        self._ids: list[int] = []
        self._sent = ""
        self.stopped = False          # a stop string was met: nothing more will be sent

    @property
    def text(self) -> str:
        """The text sent so far."""
        return self._sent

    def add(self, new_ids: Sequence[int]) -> str:
        self._ids.extend(new_ids)
        return self._emit(final=False)

    def finish(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self.stopped:
            return ""
        text, self.stopped = cut_at_stop(self._decode(self._ids), self._stop)
        if not (final or self.stopped):
            text = text.rstrip(_INCOMPLETE)       # a character whose bytes have not all come
            text = text[:len(text.rstrip())]     # whitespace a later piece may still change
            text = text[:len(text) - self._stop_prefix(text)]     # could be the start of a stop string
        if not text.startswith(self._sent) or len(text) <= len(self._sent):
            # The decoder changed text already sent (it cannot be taken back): send only what grew.
            return ""
        delta, self._sent = text[len(self._sent):], text
        return delta

    def _stop_prefix(self, text: str) -> int:
        """The length of the longest end of ``text`` that begins a stop string."""
        return max((k for s in self._stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
