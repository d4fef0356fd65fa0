"""The OpenAI completions API's shapes: a request body checked field by field (errors name the field), and the
response, stream chunk and error bodies (docs/inference.md, "Serving"). No HTTP here: server.py routes."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from hybrid_attention.checks import is_finite_number, is_int
from hybrid_attention.inference.requests import SEED_RANGE, SamplingParams

MAX_PROMPTS = 64  # prompts in one request; each is a sequence of its own
MAX_STOPS = 4  # as OpenAI's API
# Accepted when they ask for what the server does anyway; anything else is refused by name.
NEUTRAL = {
    "best_of": 1,
    "echo": False,
    "logprobs": None,
    "suffix": None,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": {},
}
KNOWN = {
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "user",
    "n",
    *NEUTRAL,
}


class ApiError(Exception):
    """An error response: HTTP status, message, the request field it is about, OpenAI's error type and code."""

    def __init__(self, status: int, message: str, *, param=None, kind="invalid_request_error", code=None, headers=None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, kind=self.kind, param=self.param, code=self.code)


def error_body(message: str, *, kind: str, param=None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class CompletionRequest:
    prompts: list[list[int]]  # token ids, one list per choice: each prompt n times in a row
    params: list[SamplingParams]  # one per choice (the copies of a seeded prompt draw from seed, seed + 1, ...)
    stream: bool
    include_usage: bool


def _bad(param: str, message: str, code=None) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code=code)


def _optional(body: dict, name: str, check, expected: str, default):
    """body[name] if it passes `check`, `default` when absent or null; else a 400 naming the field."""
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise _bad(name, f"expected {expected}, got {_show(value)}")
    return value


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _prompts(value, tokenizer, vocab_size: int) -> list[list[int]]:
    """A string, a list of strings, a list of token ids or a list of such lists -> token id lists."""
    is_ids = lambda v: isinstance(v, list) and v and all(is_int(t) for t in v)  # noqa: E731
    if isinstance(value, str) or is_ids(value):
        items = [value]
    elif isinstance(value, list) and value and all(isinstance(v, str) or is_ids(v) for v in value):
        items = value
    else:
        raise _bad("prompt", "expected a string, a list of strings, or token ids (a list of integers, or of lists)")
    if len(items) > MAX_PROMPTS:
        raise _bad("prompt", f"{len(items)} prompts in one request; at most {MAX_PROMPTS}")
    prompts = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            try:
                ids = tokenizer.encode(item)
            except UnicodeEncodeError:
                raise _bad("prompt", f"prompt {i} is not valid Unicode text") from None
        else:
            ids = list(item)
            if any(not 0 <= t < vocab_size for t in ids):
                raise _bad("prompt", f"prompt {i} holds token ids outside [0, {vocab_size})")
        if not ids:
            raise _bad("prompt", f"prompt {i} is empty; generation needs at least one token to start from")
        prompts.append(ids)
    return prompts


def parse_completion(body, *, tokenizer, vocab_size: int, model_name: str, max_context: int) -> CompletionRequest:
    """Check a /v1/completions body: ApiError (400 naming the field, 404 for another model) or the request."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise _bad(unknown[0], "unrecognized request argument")
    for name, neutral in NEUTRAL.items():
        if body.get(name) is not None and body[name] != neutral:
            raise _bad(name, f"not supported by this server (only {_show(neutral)})")
    model = body.get("model")
    if model is not None and model != model_name:
        raise ApiError(
            404,
            f"the model {_show(model)} does not exist; this server serves {model_name!r}",
            param="model",
            code="model_not_found",
        )
    if "prompt" not in body:
        raise _bad("prompt", "missing (a string, a list of strings, or token ids)")
    prompts = _prompts(body["prompt"], tokenizer, vocab_size)
    max_tokens = _optional(body, "max_tokens", lambda v: is_int(v) and v >= 1, "an integer >= 1", 16)
    temperature = _optional(
        body, "temperature", lambda v: is_finite_number(v) and 0 <= v <= 2, "a number in [0, 2]", 1.0
    )
    top_p = _optional(body, "top_p", lambda v: is_finite_number(v) and 0 < v <= 1, "a number in (0, 1]", None)
    top_k = _optional(body, "top_k", lambda v: is_int(v) and (v >= 1 or v == -1), "an integer >= 1 (-1: none)", None)
    in_range = lambda v: is_int(v) and SEED_RANGE[0] <= v <= SEED_RANGE[1]  # noqa: E731
    seed = _optional(body, "seed", in_range, "an integer in [-2**63, 2**64)", None)
    stop = _optional(body, "stop", lambda v: isinstance(v, (str, list)), "a string or a list of strings", [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
        raise _bad("stop", f"expected at most {MAX_STOPS} non-empty strings, got {_show(stop)}")
    stream = _optional(body, "stream", lambda v: isinstance(v, bool), "true or false", False)
    options = _optional(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    if options and not stream:
        raise _bad("stream_options", "only allowed with stream: true")
    if set(options) - {"include_usage"} or not isinstance(options.get("include_usage", False), bool):
        raise _bad("stream_options", 'expected {"include_usage": true or false}')
    _optional(body, "user", lambda v: isinstance(v, str), "a string", None)
    n = _optional(body, "n", lambda v: is_int(v) and v >= 1, "an integer >= 1", 1)
    if n * len(prompts) > MAX_PROMPTS:
        raise _bad("n", f"{len(prompts)} prompts x n={n} completions; at most {MAX_PROMPTS} in one request")
    longest = max(len(p) for p in prompts)
    if longest >= max_context:
        raise _bad(
            "prompt",
            f"{longest} tokens; this server's context is {max_context} tokens, prompt and completion together",
            code="context_length_exceeded",
        )
    if longest + max_tokens > max_context:
        raise _bad(
            "max_tokens",
            f"{longest} prompt tokens + {max_tokens} to generate exceed this server's context of {max_context} tokens",
            code="context_length_exceeded",
        )
    params = [
        SamplingParams(
            max_tokens=max_tokens,
            temperature=float(temperature),
            top_p=top_p,
            top_k=None if top_k == -1 else top_k,
            seed=None if seed is None else _copy_seed(seed, copy),
            stop=tuple(stop),
        )
        for copy in range(n)
    ]
    choices = [prompt for prompt in prompts for _ in range(n)]  # OpenAI's order: choice i is prompt i // n
    return CompletionRequest(choices, params * len(prompts), stream, bool(options.get("include_usage", False)))


def _copy_seed(seed: int, copy: int) -> int:
    """The seed of copy `copy` of a prompt: seed + copy, wrapped into SEED_RANGE (copy 0 is the request's own, so n=1
    and the first of n draw the same completion)."""
    value = seed + copy
    return value - 2**64 if value > SEED_RANGE[1] else value


def new_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return dict(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )


def completion_body(completion_id: str, model: str, choices: list[tuple[str, str]], tokens: tuple[int, int]) -> dict:
    """The whole response: choices [(text, finish_reason)] in prompt order, tokens (prompt, completion) in all."""
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": i, "text": text, "logprobs": None, "finish_reason": reason}
            for i, (text, reason) in enumerate(choices)
        ],
        "usage": usage(*tokens),
    }


def chunk_body(completion_id: str, model: str, choices: list, *, include_usage: bool = False, usage_=None) -> dict:
    """One streamed chunk: choices [(index, new text, finish_reason or None)]. With include_usage every chunk has a
    usage field, null but in the last one (whose choices are empty)."""
    body = {
        "id": completion_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": i, "text": text, "logprobs": None, "finish_reason": reason} for i, text, reason in choices
        ],
    }
    if include_usage:
        body["usage"] = usage_
    return body


class ChunkEncoder:
    """The stream chunks of one completion as server-sent events, `chunk_body`'s JSON built from a template: the
    fields every chunk repeats are encoded once, each chunk encodes only its texts (one `json.dumps` per choice)."""

    def __init__(self, completion_id: str, model: str, *, include_usage: bool = False):
        fixed = {"id": completion_id, "object": "text_completion", "created": int(time.time()), "model": model}
        self._head = "data: " + json.dumps(fixed)[:-1] + ', "choices": ['
        self._tail = '], "usage": null}\n\n' if include_usage else "]}\n\n"

    def encode(self, choices: list) -> str:
        """choices [(index, new text, finish_reason or None)] -> one `data: {...}` event."""
        return (
            self._head
            + ", ".join(
                f'{{"index": {i}, "text": {json.dumps(text)}, "logprobs": null, "finish_reason": {json.dumps(reason)}}}'
                for i, text, reason in choices
            )
            + self._tail
        )
