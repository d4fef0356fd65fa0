"""Cold starts of the Triton kernels: autotuning choices kept on disk, first configs only for tools and tests, and a
word on the terminal while compiling (docs/kernels.md, "Cold starts").
"""

from __future__ import annotations

import contextlib
import inspect
import threading

import triton

ANNOUNCE_AFTER_S = 0.5  # loading a cached kernel takes milliseconds; compiling one takes seconds

# `cache_results` exists from Triton 3.3 on; without it each process tunes again (still correct).
AUTOTUNE_OPTIONS = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}

# Every autotuned kernel of the package, in definition order: each tuner also lists all its configs in `all_configs`.
TUNERS: list = []
# The (tuner, configs) pairs each open `first_configs_only` restores on exit, innermost last.
_RESTORE: list[list] = []


def register_tuner(tuner):
    """Adds a `triton.autotune` tuner with an `all_configs` list to TUNERS (see `first_configs_only`); returns it."""
    if not hasattr(tuner, "all_configs"):
        raise ValueError(f"register_tuner: the tuner of {tuner.fn.__name__} needs an all_configs list of its configs")
    TUNERS.append(tuner)
    if _RESTORE:  # a module imported inside first_configs_only: its kernels take part too
        _RESTORE[-1].append((tuner, tuner.configs))
        tuner.configs = tuner.all_configs[:1]
    return tuner


@contextlib.contextmanager
def first_configs_only():
    """Inside: every registered tuner (also one registered inside) runs the first of its configs, untimed; their
    config lists come back after."""
    saved = [(tuner, tuner.configs) for tuner in TUNERS]
    for tuner in TUNERS:
        tuner.configs = tuner.all_configs[:1]
    _RESTORE.append(saved)
    try:
        yield
    finally:
        _RESTORE.pop()
        for tuner, configs in reversed(saved):
            tuner.configs = configs


class CompileNotice:
    """Prints `compiling Triton kernel NAME ...` through `echo` when a compilation outlasts `after_s` seconds.

    `start(name)` and `end(name)` bracket one compilation (Triton's pre- and post-compile hooks call them); a timer
    thread prints while the compilation is still running, since the compiler holds the main thread.
    """

    def __init__(self, echo, *, after_s: float = ANNOUNCE_AFTER_S, cache_dir: str | None = None):
        self.echo = echo
        self.after_s = after_s
        self.cache_dir = cache_dir
        self.announced: set[str] = set()
        self._lock = threading.Lock()
        self._running: set[str] = set()  # names whose compilation has started and not ended
        self._timers: dict[str, threading.Timer] = {}
        self._first = True

    def start(self, name: str) -> None:
        with self._lock:
            self._running.add(name)
            if name not in self.announced and name not in self._timers:
                timer = threading.Timer(self.after_s, self._announce, args=(name,))
                timer.daemon = True
                self._timers[name] = timer
                timer.start()

    def end(self, name: str) -> None:
        with self._lock:
            self._running.discard(name)
            timer = self._timers.pop(name, None)
        if timer is not None:
            timer.cancel()

    def _announce(self, name: str) -> None:
        with self._lock:
            if name not in self._running or name in self.announced:
                return
            self._timers.pop(name, None)
            self.announced.add(name)
            first, self._first = self._first, False
        where = f" in {self.cache_dir}" if self.cache_dir else ""
        note = f" (once per GPU architecture and Triton version; later runs load it from the cache{where})"
        self.echo(f"compiling Triton kernel {name} ..." + (note if first else ""))


_installed: CompileNotice | None = None


def announce_compilation(echo) -> CompileNotice | None:
    """Install Triton hooks that report long compilations through `echo` (a function taking one line); once per
    process (later calls only replace `echo`). Hooks already installed by someone else keep running, chained before
    ours. Returns the notice, or None when this Triton has no compilation hooks."""
    global _installed
    knobs = getattr(triton, "knobs", None)
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook") or not hasattr(runtime, "jit_post_compile_hook"):
        return None
    if _installed is not None:
        _installed.echo = echo
        return _installed
    notice = CompileNotice(echo, cache_dir=getattr(getattr(knobs, "cache", None), "dir", None))
    before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook

    def on_start(*args, **kwargs):
        skip = before(*args, **kwargs) if before is not None else None
        if not skip:  # a true result from an earlier hook means no compilation follows
            notice.start(kwargs["fn"].name)
        return skip

    def on_end(*args, **kwargs):
        notice.end(kwargs["fn"].name)
        return after(*args, **kwargs) if after is not None else None

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = on_start, on_end
    _installed = notice
    return notice
