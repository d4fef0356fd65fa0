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
        # Only a window of the text is kept, so a long completion costs linear time: the unsent text, and before it
        # the last `longest - 1` sent characters (where a stop string ending in new text may begin).
        self._before = ""
        self._unsent = ""
        self.stopped = False

    def add(self, token_id: int) -> tuple[str, bool]:
        """(text to send, stopped) after one more token; nothing more once stopped."""
        if self.stopped:
            return "", True
        self._unsent += self._decoder.decode(self._tokenizer.token_bytes(token_id))
        return self._advance(final=False)

    def flush(self) -> str:
        """The rest of the text at the end of the completion (bytes of an unfinished character become U+FFFD)."""
        if self.stopped:
            return ""
        self._unsent += self._decoder.decode(b"", final=True)
        return self._advance(final=True)[0]

    def _advance(self, *, final: bool) -> tuple[str, bool]:
        if self._stop:
            window = self._before + self._unsent
            hits = [i for i in (window.find(s) for s in self._stop) if i >= 0]
            if hits:
                self.stopped = True
                return self._take(max(0, min(hits) - len(self._before))), True
        return self._take(len(self._unsent) if final else len(self._unsent) - self._held()), False

    def _held(self) -> int:
        """Characters at the end of the unsent text that begin some stop string (they may yet complete it)."""
        for n in range(min(self._longest - 1, len(self._unsent)), 0, -1):
            tail = self._unsent[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0

    def _take(self, count: int) -> str:
        """Send the first `count` unsent characters."""
        piece, self._unsent = self._unsent[:count], self._unsent[count:]
        keep = self._longest - 1
        self._before = (self._before + piece)[-keep:] if keep > 0 else ""
        return piece
