"""Incremental detokenisation with stop strings: the text a request streams, piece by piece.

Each new token re-decodes the request's tokens (special tokens skipped, no clean-up of spaces, so a
prefix's text stays a prefix of the whole text). A piece is released only when it cannot change any more:
a trailing U+FFFD (an incomplete UTF-8 character) and a tail that could still become a stop string are held
back. So the pieces streamed always add up to the final text, and a stop string is never streamed.
"""

from __future__ import annotations

from collections.abc import Sequence


class Decoder:
    """What `TextStream` needs of a tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _held_tail(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    held = (k for s in stop for k in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:k]))
    return max(held, default=0)


class TextStream:
    """The released text of one request; `push` the tokens one by one, `finish` at the end."""

    def __init__(self, decode, stop: Sequence[str] = ()):
        self.decode, self.stop = decode, tuple(stop)
        self.ids: list[int] = []
        self.text = ""
        """Text released so far."""
        self.stopped = False
        """A stop string was found: the text ends before it."""

    def push(self, token: int) -> str:
        """Add one generated token; returns the newly released text ('' if nothing is safe yet)."""
        self.ids.append(token)
        full = self.decode(self.ids)
        cut = self._stop_index(full)
        if cut is not None:
            self.stopped = True
            return self._release(full[:cut])
        if full.endswith("\ufffd"):
            return ""
        return self._release(full[: len(full) - _held_tail(full, self.stop)])

    def finish(self) -> str:
        """The request ended (EOS, cap, abort): release what was held back."""
        if self.stopped:
            return ""
        return self._release(self.decode(self.ids).rstrip("\ufffd"))

    def _stop_index(self, full: str) -> int | None:
        hits = (full.find(s, max(0, len(self.text) - len(s) + 1)) for s in self.stop)
        return min((i for i in hits if i >= 0), default=None)

    def _release(self, text: str) -> str:
        if len(text) <= len(self.text) or not text.startswith(self.text):
            return ""  # never take back released text
        piece, self.text = text[len(self.text) :], text
        return piece
