"""A completion's text as its tokens arrive: bytes decoded incrementally (a character may span tokens), stop strings
found across token boundaries, and text that may still turn into a stop string held back until it cannot."""

from __future__ import annotations

import codecs


class CompletionText:
    """Feed token ids with `add`; each call returns the text that is now safe to send and whether a stop string was
    reached (the text then ends just before it, as OpenAI's API does). `flush` returns what is held back at the end.

    tokenizer: anything with `token_bytes(id) -> bytes`; stop: the stop strings (non-empty).
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(stop)
        self._longest = max((len(s) for s in self._stop), default=0)
        self.text = ""  # everything decoded so far (up to the stop string once stopped)
        self._sent = 0  # characters of self.text already returned
        self.stopped = False

    def add(self, token_id: int) -> tuple[str, bool]:
        """(text to send, stopped) after one more token; nothing more once stopped."""
        if self.stopped:
            return "", True
        self.text += self._decoder.decode(self._tokenizer.token_bytes(token_id))
        return self._advance(final=False)

    def flush(self) -> str:
        """The rest of the text at the end of the completion (bytes of an unfinished character become U+FFFD)."""
        if self.stopped:
            return ""
        self.text += self._decoder.decode(b"", final=True)
        return self._advance(final=True)[0]

    def _advance(self, *, final: bool) -> tuple[str, bool]:
        if self._stop:
            # A stop string ending in the new text starts at most `longest - 1` characters before the unsent part.
            start = max(0, self._sent - self._longest + 1)
            hits = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                return self._take(len(self.text)), True
        return self._take(len(self.text) if final else len(self.text) - self._held()), False

    def _held(self) -> int:
        """Characters at the end of the text that begin some stop string (they may yet complete it)."""
        for n in range(min(self._longest - 1, len(self.text) - self._sent), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0

    def _take(self, end: int) -> str:
        piece = self.text[self._sent : end]
        self._sent = max(self._sent, end)
        return piece
