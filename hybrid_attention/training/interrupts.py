"""Stopping a training job cleanly: the first SIGINT (Ctrl-C) or SIGTERM asks the loop to save and stop after the
current step; a second one aborts at once (KeyboardInterrupt), leaving the last committed checkpoint."""

from __future__ import annotations

import signal
import sys
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequests:
    """`with StopRequests() as stop:` installs the handlers (main thread only; elsewhere they stay as they were and
    `stop.signal` stays None). `stop.signal` is the name of the first signal received, e.g. "SIGINT"."""

    def __init__(self, echo=None):
        self.signal: str | None = None
        self._received: list[int] = []  # list.append is atomic: safe when a second handler runs inside the first
        self._echo = echo or (lambda text: print(text, file=sys.stderr, flush=True))
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        # Python may run the second signal's handler between any two bytecodes of the first one: count first, so
        # whichever handler sees two requests aborts, whatever the interleaving.
        self._received.append(signum)
        if len(self._received) > 1:
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name
        self._echo(f"\n{self.signal}: saving a checkpoint after this step, then stopping (again to abort at once)")

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


def exit_code(name: str) -> int:
    """128 + the number of the signal `name` (e.g. "SIGINT" -> 130), the shell's convention for a job it ended."""
    return 128 + int(signal.Signals[name])
