"""What a caller hands the serving engine and gets back: sampling settings, one prompt's request, its events."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from hybrid_attention.checks import is_finite_number, is_int
from hybrid_attention.inference.scheduler import Sequence

SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
ENDINGS = ("stop", "length", "cancelled", "error")  # how a request ends (the engine counts each, /metrics shows them)


@dataclass(frozen=True)
class SamplingParams:
    """How one completion is sampled; each field is checked, with a ValueError that names it.

    max_tokens: tokens to generate (the completion ends earlier at a stop string). temperature: 0 is greedy. top_k,
    top_p: None for no limit. seed: the request's own generator (None: a random one). stop: up to 4 strings that end
    the completion (not included in its text).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self):
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r}; expected an integer >= 1")
        temperature = self.temperature
        if not is_finite_number(temperature) or not (temperature == 0 or sys.float_info.min <= temperature <= 2):
            raise ValueError(f"temperature={temperature!r}; expected a number in [0, 2] (0 is greedy)")
        if self.top_p is not None and (not is_finite_number(self.top_p) or not 0 < self.top_p <= 1):
            raise ValueError(f"top_p={self.top_p!r}; expected a number in (0, 1]")
        if self.top_k is not None and (not is_int(self.top_k) or self.top_k < 1):
            raise ValueError(f"top_k={self.top_k!r}; expected an integer >= 1 (or none for no limit)")
        if self.seed is not None and (not is_int(self.seed) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise ValueError(f"seed={self.seed!r}; expected an integer in [-2**63, 2**64)")
        stop = self.stop
        if not isinstance(stop, tuple) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop={stop!r}; expected at most 4 non-empty strings")


@dataclass
class Event:
    """What the engine reports about a request: new text, and at the end why it ended and how many tokens it took.

    finish_reason: "stop" (a stop string), "length" (max_tokens) or None while it runs. error: the request failed
    (the text says why; status is the HTTP status that fits: 500 for a fault, 503 when the server shuts down).
    """

    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    status: int = 200
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class Request:
    """One prompt in the engine: token ids [T], sampling settings, and `sink`, called with each `Event` (on the
    thread the engine's `deliver` picks). `index`: the caller's position for it (the choice index of a response)."""

    def __init__(self, prompt: list[int], params: SamplingParams, sink: Callable[[Event], None], *, index: int = 0):
        if not prompt:
            raise ValueError("the prompt is empty; generation needs at least one token to start from")
        self.prompt = list(prompt)
        self.params = params
        self.sink = sink
        self.index = index
        self.seq = Sequence(len(self.prompt), params.max_tokens, owner=self)
        self.tokens: list[int] = []  # generated so far
        self.finished = False  # its final event is out, or it was cancelled
        self.text = None  # a CompletionText, set by the engine
        self.generator = None  # a torch.Generator for sampled requests, set by the engine
