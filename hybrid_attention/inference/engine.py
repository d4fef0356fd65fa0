"""The serving engine: one loop owns the device; requests join and leave the batch between its iterations (continuous
batching). Each iteration admits, prefills chunks, decodes every running sequence from a CUDA graph over the paged
cache, samples on the device and hands out the previous iteration's tokens (docs/inference.md, "Serving"). An
exception in one request's work fails that request alone.
"""

from __future__ import annotations

import random
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybrid_attention.device import to_device
from hybrid_attention.inference.completion_text import CompletionText
from hybrid_attention.inference.decode_graph import DecodeStep
from hybrid_attention.inference.engine_config import EngineConfig, cache_pages
from hybrid_attention.inference.generate import sample_next_token
from hybrid_attention.inference.packed_prefill import PackedPrefill
from hybrid_attention.inference.paged_cache import PagedCache
from hybrid_attention.inference.prefill import prefill_chunk_size
from hybrid_attention.inference.requests import ENDINGS, Event, Request, SamplingParams
from hybrid_attention.inference.scheduler import (
    DECODING,
    WAITING,
    Clear,
    Move,
    PrefillChunk,
    QueueFull,
    Scheduler,
    ShuttingDown,
)
from hybrid_attention.inference.transfers import HostCopy
from hybrid_attention.layers.packed import PackedProjections

RATE_WINDOW_S = 10.0  # tokens/s is measured over this much recent time
# The prefill budget of an iteration without decoding sequences on a CPU, whose attention path materialises a chunk's
# scores: larger chunks cost more there than their fewer passes over the prefix save (on a GPU: prefill.py's choice).
CPU_IDLE_PREFILL_TOKENS = 1024
COUNTERS = ("generated_tokens", "prompt_tokens", "prefill_chunks", *(f"finished_{o}" for o in ENDINGS))


@dataclass
class _Sampled:
    """Tokens sampled on the device for `requests` (one each), read on the host an iteration later."""

    requests: list[Request]
    tokens: HostCopy


def _deliver_now(items: list[tuple[Request, Event]]) -> None:
    for request, event in items:
        request.sink(event)


def _describe(exc: BaseException | str) -> str:
    """The error text of an event; an exception is also logged with its traceback (the server's stderr)."""
    if isinstance(exc, str):
        return exc
    print(f"hybrid-attention serve: a request failed:\n{''.join(traceback.format_exception(exc))}", file=sys.stderr)
    return f"generation failed: {type(exc).__name__}: {exc}"


class Engine:
    """Continuous batching for `model` (a `HybridLM` in eval mode, on its device and dtype) with `tokenizer`.

    deliver: called from the engine's thread once per iteration with that iteration's (request, event) pairs (the
    server hands them to its event loop); default: each request's sink, called right there.
    """

    def __init__(self, model, tokenizer, config: EngineConfig | None = None, *, deliver=None):
        self.model, self.tokenizer = model.eval(), tokenizer
        self.config = c = config or EngineConfig()
        weight = model.embed.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.deliver: Callable[[list[tuple[Request, Event]]], None] = deliver or _deliver_now
        self.cuda_graphs = self.device.type == "cuda" if c.cuda_graphs is None else c.cuda_graphs
        slots = c.max_running + c.max_prefilling
        # The prefill budget of an iteration without decoding sequences: a prompt alone prefills as prefill.py would.
        idle = prefill_chunk_size(model, 1) if self.device.type == "cuda" else CPU_IDLE_PREFILL_TOKENS
        self.max_batched_tokens = c.batched_tokens(self.device)
        self.idle_prefill_tokens = c.max_prefill_chunk or max(self.max_batched_tokens, idle)
        measure = self.device.type == "cuda" and c.num_pages is None
        activation = self._prefill_peak_bytes(self.idle_prefill_tokens) if measure else 0
        self.num_pages = cache_pages(
            c,
            page_bytes=PagedCache.page_bytes(model, c.page_size, self.dtype),
            device=self.device,
            activation_bytes=activation + slots * PagedCache.slot_bytes(model, self.dtype),
        )
        self.cache = PagedCache(
            model,
            num_pages=self.num_pages,
            page_size=c.page_size,
            num_slots=slots,
            max_context=c.max_context,
            device=self.device,
            dtype=self.dtype,
        )
        self.scheduler = Scheduler(
            max_running=c.max_running,
            max_prefilling=c.max_prefilling,
            num_pages=self.num_pages,
            page_size=c.page_size,
            max_queue=c.max_queue,
            max_batched_tokens=self.max_batched_tokens,
            idle_prefill_tokens=self.idle_prefill_tokens,
        )
        self.batch_sizes = c.decode_batch_sizes()
        self.next_tokens = torch.zeros(c.max_running, dtype=torch.long, device=self.device)  # each decode slot's input
        self.packed = PackedProjections(model)
        self.steps: dict[int, DecodeStep] = {}
        self.counters = dict.fromkeys(COUNTERS, 0)  # every key from the start: /metrics reads it from another thread
        self._rate: deque[tuple[float, int]] = deque()
        self._pending: list[_Sampled] = []
        self._outbox: list[tuple[Request, Event]] = []
        self._lock = threading.Condition()
        self._inbox: list[Request] = []
        self._cancels: list[Request] = []
        self._queued = 0  # requests submitted and not yet admitted (the queue max_queue bounds)
        self._drain_deadline: float | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None

    # -------------------------------------------------------------------------------- the API (any thread)
    def submit(self, requests: list[Request]) -> None:
        """Queue requests, all or none: QueueFull when the queue has no room for them, ShuttingDown while draining,
        ValueError when one cannot fit the context."""
        for request in requests:
            total = len(request.prompt) + request.params.max_tokens
            if total > self.config.max_context:
                raise ValueError(
                    f"this server's context is {self.config.max_context} tokens, but the request asks for {total} "
                    f"({len(request.prompt)} in the prompt, {request.params.max_tokens} to generate)"
                )
        with self._lock:
            if self._drain_deadline is not None or self._stopping:
                raise ShuttingDown("the server is shutting down and takes no new requests")
            if self._queued + len(requests) > self.config.max_queue:
                raise QueueFull(f"the queue is full ({self._queued} of {self.config.max_queue} requests waiting)")
            self._queued += len(requests)
            self._inbox.extend(requests)
            self._lock.notify()

    def cancel(self, requests: list[Request]) -> None:
        """Stop these requests and free their cache (their client went away); nothing more is delivered."""
        with self._lock:
            self._cancels.extend(requests)
            self._lock.notify()

    def stats(self) -> dict:
        """Counts for /metrics (read from any thread; each number is current, together they are nearly so)."""
        s = self.scheduler
        now = time.monotonic()
        recent = sum(n for t, n in list(self._rate) if t > now - RATE_WINDOW_S)
        return dict(
            queue_depth=self._queued,
            running=s.num_running,
            decoding=len(s.decoding),
            pages_used=s.pages.num_used,
            pages_total=self.num_pages,
            slots_used=len(s.decoding) + s.prefill_slots.num_used,
            tokens_per_s=recent / RATE_WINDOW_S,
            **self.counters,
        )

    def warm_up(self) -> None:
        """Before serving: a short request, and a longer one that prefills in chunks over its cached prefix while the
        first decodes (kernels compile and specialise, libraries load), then the decode step of every batch size
        (captured in CUDA graphs, with cuda_graphs)."""
        c, errors = self.config, []

        def request(length: int, max_tokens: int) -> Request:
            prompt = torch.randint(0, self.model.config.vocab_size, (max(1, length),)).tolist()
            return Request(prompt, SamplingParams(max_tokens=max_tokens), lambda e: e.error and errors.append(e.error))

        self.submit([request(min(17, c.max_context - 8), 8), request(min(9, c.max_context - 8), 8)])  # packed
        while not (self.idle() or self.scheduler.decoding):
            self.step()
        self.submit([request(min(2 * self.max_batched_tokens + 17, c.max_context - 3), 3)])
        while not self.idle():
            self.step()
        if errors:
            raise RuntimeError(f"the engine's warm-up request failed: {errors[0]}")
        if self.cuda_graphs:
            for size in self.batch_sizes:
                self._step(size)
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._rate.clear()

    def start(self) -> None:
        """Run the loop on its own thread."""
        self._thread = threading.Thread(target=self._run, name="hybrid-attention-engine", daemon=True)
        self._thread.start()

    def drain(self, timeout: float) -> None:
        """Stop admitting: waiting requests are refused (503), running ones may finish for `timeout` seconds, then
        are ended with an error."""
        with self._lock:
            if self._drain_deadline is None:
                self._drain_deadline = time.monotonic() + timeout
            self._lock.notify()

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None or self._stopping

    def idle(self) -> bool:
        return self.scheduler.idle() and not self._pending and not self._inbox

    def stop(self) -> None:
        """End the loop (what still runs fails with 503) and wait for its thread."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()

    def _prefill_peak_bytes(self, tokens: int) -> int:
        """Device memory a forward of `tokens` tokens takes beyond what is allocated (the largest prefill chunk's
        activations), measured once."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        ids = torch.zeros(1, tokens, dtype=torch.long, device=self.device)
        with torch.no_grad():
            self.model(ids, logits_to_keep=1)  # as a prompt's last chunk: the logits of one position
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()  # so that the free memory the pages are sized from does not count it twice
        return peak

    # --------------------------------------------------------------------------------- the loop (its thread)
    def _run(self) -> None:
        if self.device.type == "cuda":  # kernels launch on the thread's current device
            torch.cuda.set_device(self.device)
        else:  # the flag is per thread: KDA's decay products make denormals, slow on CPUs
            torch.set_flush_denormal(True)
        while True:
            with self._lock:
                while not (self._stopping or self._inbox or self._cancels or not self.idle()):
                    self._lock.wait()
                if self._stopping:
                    break
            try:
                self.step()
            except Exception as exc:  # outside any one request's work: end what runs, keep serving
                self._fail_all(exc)
        self._fail_all("the server is shutting down", status=503)

    def step(self) -> None:
        """One iteration: admit, prefill chunks, decode every running sequence, hand out the previous tokens."""
        self._take_inbox()
        if self._drain_deadline is None:
            for seq in self.scheduler.admit():
                self._admitted(seq.owner)
        sampled = []
        chunks = self.scheduler.prefill_plan()
        starting = [chunk for chunk in chunks if chunk.start == 0]
        if len(starting) > 1:  # new prompts: one packed forward (inference/packed_prefill.py)
            sampled += self._prefill_packed(starting)
            chunks = [chunk for chunk in chunks if chunk.start > 0]
        for chunk in chunks:
            sampled += self._prefill(chunk)
        if self.scheduler.decoding:
            sampled += self._decode()
        ready, self._pending = self._pending, sampled
        for record in ready:
            self._emit(record)
        self._flush()

    def prefill_chunk(self, request: Request, slot: int, start: int, end: int) -> torch.Tensor | None:
        """Run prompt tokens [start, end) of the sequence in `slot` through the model, into its pages and KDA rows;
        the logits [1, vocab] of the prompt's last token once `end` reaches it, else None. The one place a prompt
        chunk runs: the MLA layers read the cached prefix page by page (`PagedLatentCache.prefix_reader`)."""
        batch = self.cache.batch(slot, 1)
        batch.seqlens.set([start])
        ids = to_device(request.prompt[start:end], self.device).view(1, -1)
        last = end == len(request.prompt)
        with torch.no_grad():
            out = self.model(ids, cache=batch, return_logits=last, logits_to_keep=1, decode=self.packed)
        return out.logits[:, -1] if last else None

    def prefill_packed(self, chunks: list[PrefillChunk]) -> torch.Tensor | None:
        """Run the first chunks of several prompts (each chunk.start == 0, slots cleared) as packed documents of one
        forward, each into its own pages and KDA rows; the logits [n, vocab] of the prompts' last tokens, for the n
        chunks that end their prompts (in order), or None when none does."""
        ids, ends, keep = [], [0], []
        for chunk in chunks:
            ids += chunk.seq.owner.prompt[: chunk.end]
            ends.append(ends[-1] + chunk.end)
            if chunk.last:
                keep.append(ends[-1] - 1)
        cache = PackedPrefill(self.cache, [chunk.seq.slot for chunk in chunks])
        positions = to_device(keep, self.device) if keep else 0
        with torch.no_grad():
            out = self.model(
                to_device(ids, self.device).view(1, -1),
                cache=cache,
                cu_seqlens=torch.tensor(ends, dtype=torch.int32),  # on the host: no device sync to read it
                return_logits=bool(keep),
                logits_to_keep=positions,
                decode=self.packed,  # one product for a layer's input projections: fewer launches
            )
        return out.logits[0] if keep else None

    def _take_inbox(self) -> None:
        with self._lock:
            new, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
            deadline = self._drain_deadline
        for request in new:
            request.text = CompletionText(self.tokenizer, request.params.stop)
            if request.params.temperature > 0:
                seed = request.params.seed if request.params.seed is not None else random.getrandbits(63)
                request.generator = torch.Generator(device=self.device).manual_seed(seed)
            self.scheduler.add([request.seq])
        for request in cancels:
            self._end(request, None)
        if deadline is not None:
            for seq in list(self.scheduler.waiting):
                self._end(seq.owner, Event(error="the server is shutting down", status=503))
            if time.monotonic() > deadline:
                for seq in self.scheduler.prefilling + self.scheduler.decoding:
                    self._end(seq.owner, Event(error="the server shut down before the completion ended", status=503))

    def _admitted(self, request: Request) -> None:
        with self._lock:
            self._queued -= 1
        seq = request.seq
        self.cache.clear_slot(seq.slot)
        self.cache.set_pages(seq.slot, seq.pages)

    def _prefill(self, chunk: PrefillChunk) -> list[_Sampled]:
        request = chunk.seq.owner
        self.counters["prefill_chunks"] += 1
        try:
            logits = self.prefill_chunk(request, chunk.seq.slot, chunk.start, chunk.end)
            token = None
            if chunk.last:
                token, failed = self._sample(logits, [request])
                if failed:
                    raise failed[0][1]
            self._apply(self.scheduler.prefilled(chunk))
        except Exception as exc:
            self._fail(request, exc)
            return []
        if token is None:
            return []
        if chunk.seq.state == DECODING:
            self.next_tokens[chunk.seq.slot].copy_(token[0])
        return [_Sampled([request], HostCopy(token))]

    def _prefill_packed(self, chunks: list[PrefillChunk]) -> list[_Sampled]:
        ending = [chunk for chunk in chunks if chunk.last]
        try:
            logits = self.prefill_packed(chunks)
            tokens, failed = self._sample(logits, [c.seq.owner for c in ending]) if ending else (None, [])
        except Exception:  # which request failed is unknown: run each alone, from cleared slots
            sampled = []
            for chunk in chunks:
                self.cache.clear_slot(chunk.seq.slot)
                sampled += self._prefill(chunk)
            return sampled
        self.counters["prefill_chunks"] += len(chunks)
        for chunk in chunks:
            self._apply(self.scheduler.prefilled(chunk))
        for row, chunk in enumerate(ending):
            if chunk.seq.state == DECODING:
                self.next_tokens[chunk.seq.slot].copy_(tokens[row])
        for request, exc in failed:
            self._fail(request, exc)
        return [_Sampled([c.seq.owner for c in ending], HostCopy(tokens))] if ending else []

    def _decode(self) -> list[_Sampled]:
        rows = list(self.scheduler.decoding)
        requests = [seq.owner for seq in rows]
        n = len(rows)
        size = next(b for b in self.batch_sizes if b >= n)
        try:
            step = self._step(size)
            step.cache.seqlens.set([seq.cached for seq in rows] + [0] * (size - n))
            logits = step(self.next_tokens[:size])[:n]
            tokens, failed = self._sample(logits, requests)
        except Exception as exc:  # the batched step itself: every request in it fails
            for request in requests:
                self._fail(request, exc)
            return []
        self.next_tokens[:n].copy_(tokens)
        self._apply(self.scheduler.decoded(rows))
        for request, exc in failed:
            self._fail(request, exc)
        return [_Sampled(requests, HostCopy(tokens))]

    def _step(self, size: int) -> DecodeStep:
        """The decode step over slots [0, size): captured in a CUDA graph once (the warm-up captures them all)."""
        if size not in self.steps:
            batch = self.cache.batch(0, size)
            self.steps[size] = DecodeStep(self.model, batch, cuda_graph=self.cuda_graphs, packed=self.packed)
        return self.steps[size]

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> tuple[torch.Tensor, list]:
        """Tokens [n] on the device (greedy rows by one argmax, sampled rows each with its own generator), and the
        (request, exception) of rows whose sampling failed (they keep their argmax)."""
        tokens = logits.argmax(-1)
        failed = []
        for row, request in enumerate(requests):
            p = request.params
            if p.temperature > 0:
                try:
                    row_logits = logits[row : row + 1]
                    tokens[row] = sample_next_token(row_logits, p.temperature, p.top_k, p.top_p, request.generator)[0]
                except Exception as exc:
                    failed.append((request, exc))
        return tokens, failed

    def _apply(self, changes: list[Move | Clear]) -> None:
        """Make the device follow the scheduler: KDA rows, page-table rows and next tokens move with a sequence."""
        for change in changes:
            if isinstance(change, Move):
                self.cache.move_slot(change.src, change.dst)
                self.cache.set_pages(change.dst, change.seq.pages)
                if change.src < self.config.max_running:
                    self.next_tokens[change.dst].copy_(self.next_tokens[change.src])
            else:
                self.cache.set_pages(change.slot, [])

    def _emit(self, record: _Sampled) -> None:
        """Hand the sampled tokens to their requests (one step late: a request may have ended since)."""
        count = 0
        for request, token in zip(record.requests, record.tokens.values(), strict=True):
            if request.finished:
                continue
            count += 1
            try:
                request.tokens.append(token)
                text, stopped = request.text.add(token)
                if stopped:
                    self._end(request, Event(text, "stop"))
                elif len(request.tokens) >= request.params.max_tokens:
                    self._end(request, Event(text + request.text.flush(), "length"))
                else:  # also without text (part of a character): a client times every token
                    self._outbox.append((request, Event(text)))
            except Exception as exc:
                self._fail(request, exc)
        self._rate.append((time.monotonic(), count))
        while self._rate and self._rate[0][0] < time.monotonic() - RATE_WINDOW_S:
            self._rate.popleft()
        self.counters["generated_tokens"] += count

    def _end(self, request: Request, event: Event | None) -> None:
        """Finish a request: free its cache at once, count it, deliver its last event (None: cancelled)."""
        if request.finished:
            return
        if request.seq.state == WAITING:
            with self._lock:
                self._queued -= 1
        request.finished = True
        self._apply(self.scheduler.retire(request.seq))
        outcome = "cancelled" if event is None else event.finish_reason or "error"
        self.counters["finished_" + outcome] += 1
        self.counters["prompt_tokens"] += len(request.prompt)
        if event is not None:
            event.prompt_tokens, event.completion_tokens = len(request.prompt), len(request.tokens)
            self._outbox.append((request, event))

    def _fail(self, request: Request, exc: BaseException | str, *, status: int = 500) -> None:
        """End a request with an error event (an exception is logged with its traceback and named in the event)."""
        self._end(request, Event(error=_describe(exc), status=status))

    def _fail_all(self, exc: BaseException | str, *, status: int = 500) -> None:
        """End every request the engine holds (a fault outside any one request, or the loop stopping)."""
        message = _describe(exc)
        with self._lock:
            new, self._inbox = self._inbox, []
            self._queued -= len(new)
        for request in new:
            request.finished = True
            self._outbox.append((request, Event(error=message, status=status)))
        for seq in list(self.scheduler.waiting) + self.scheduler.prefilling + self.scheduler.decoding:
            self._end(seq.owner, Event(error=message, status=status))
        self._pending = []
        self._flush()

    def _flush(self) -> None:
        if self._outbox:
            items, self._outbox = self._outbox, []
            self.deliver(items)
