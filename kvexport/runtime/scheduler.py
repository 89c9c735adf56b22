"""Continuous batching: one thread owns the engine's cache rows and serves many requests at once.

Between two decode steps the scheduler retires finished or cancelled rows, admits queued requests
into free rows and runs prefill chunks up to a token budget (as vLLM's max_num_batched_tokens), so
a long prompt enters in pieces while the running rows keep producing a token per step, and a burst
of new requests gets its prompts in within a few steps instead of one chunk per step. Every row keeps its own absolute positions (slot i
holds position i) and its own sampling state: a request's tokens are the ones it gets alone
(`Engine.generate` with the same prompt, parameters and seed), whoever else is running.

    sched = Scheduler(kvexport.load("model.kvx"), max_batch=8)
    with sched:
        h = sched.submit("def main(", max_tokens=32, temperature=0.7, seed=1)
        for ev in h:            # StreamEvents: token id, text delta, finish reason on the last
            print(ev.text, end="")
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvexport.errors import ContextOverflowError, InputError, KvexportError
from kvexport.runtime.rows import Rows, rows_for
from kvexport.runtime.sampling import SamplingParams, sample


class QueueFullError(KvexportError):
    """The scheduler's queue holds max_queue requests already; retry later."""


class SchedulerClosedError(KvexportError):
    """The scheduler is draining (or stopped) and admits no new request."""


class RequestFailedError(KvexportError):
    """The engine failed while serving this request (the others keep running)."""


# Histogram buckets (seconds) for time to first token and inter-token latency.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


@dataclass
class Event:
    """One generated token (token_id None on a final event that carries no token) and the text it
    completed; the last event of a request carries finish_reason ("stop", "length", "cancelled",
    "error")."""

    token_id: int | None
    text: str
    index: int
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class Result:
    token_ids: list[int]
    text: str
    prompt_ids: list[int]
    finish_reason: str
    ttft: float | None = None


class Histogram:
    def __init__(self, buckets: Sequence[float]):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum, self.count = 0.0, 0

    def observe(self, v: float) -> None:
        i = 0
        while i < len(self.buckets) and v > self.buckets[i]:
            i += 1
        self.counts[i] += 1
        self.sum += v
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out, c = [], 0
        for b, n in zip([*map(str, self.buckets), "+Inf"], self.counts):
            c += n
            out.append((b, c))
        return out

    def quantile(self, q: float) -> float | None:
        """Upper bound of the bucket holding quantile q (None while empty)."""
        if not self.count:
            return None
        target, c = q * self.count, 0
        for b, n in zip([*self.buckets, float("inf")], self.counts):
            c += n
            if c >= target:
                return b
        return float("inf")


@dataclass
class Stats:
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    prefill_chunks: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)
    window: deque = field(default_factory=deque)  # (time, tokens) per decode step, last WINDOW_S seconds

    WINDOW_S = 10.0

    def record_step(self, now: float, tokens: int) -> None:
        """Called by the scheduler's thread only (readers take a snapshot)."""
        self.window.append((now, tokens))
        while self.window and self.window[0][0] < now - self.WINDOW_S:
            self.window.popleft()

    def tokens_per_second(self, now: float | None = None) -> float:
        """Tokens generated per second over the last WINDOW_S seconds."""
        now = time.monotonic() if now is None else now
        snap = [(t, n) for t, n in list(self.window) if t >= now - self.WINDOW_S]
        if not snap:
            return 0.0
        return sum(n for _, n in snap) / min(max(now - snap[0][0], 1.0), self.WINDOW_S)


_ids = itertools.count()


class Request:
    """A submitted request; iterate it for its Events (blocking), or call result()."""

    def __init__(self, prompt_ids: list[int], max_tokens: int, params: SamplingParams, stop_ids: set[int],
                 stop_strings: list[str], sink: Callable[[Event], None] | None):
        self.id = next(_ids)
        self.prompt_ids, self.max_tokens, self.params = prompt_ids, max_tokens, params
        self.stop_ids, self.stop_strings = stop_ids, stop_strings
        self.rng = np.random.default_rng(params.seed)
        self.token_ids: list[int] = []
        self.text, self.emitted = "", 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.cancelled = False
        self.row: int | None = None
        self.prefilled = 0
        self.pending: int | None = None  # sampled, not yet fed to the engine
        self.submitted = time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self._queue: queue.Queue[Event] | None = None if sink is not None else queue.Queue()
        self._sink = sink if sink is not None else self._queue.put  # type: ignore[union-attr]
        self._done = threading.Event()
        self._scheduler: Scheduler | None = None

    # --- caller side ----------------------------------------------------------------------------
    def cancel(self) -> None:
        """Stop generating: the row is freed at the scheduler's next step."""
        self.cancelled = True
        if self._scheduler is not None:
            self._scheduler._wake()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def __iter__(self) -> Iterator[Event]:
        return self.events()

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        if self._queue is None:
            raise InputError("this request delivers its events to the sink it was submitted with")
        while True:
            try:
                ev = self._queue.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no event within {timeout}s") from None
            yield ev
            if ev.finish_reason is not None:
                return

    def result(self, timeout: float | None = None) -> Result:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request not finished within {timeout}s")
        if self.finish_reason == "error":
            raise RequestFailedError(self.error or "the engine failed on this request")
        return Result(list(self.token_ids), self.text, self.prompt_ids, self.finish_reason or "stop",
                      None if self.first_token_at is None else self.first_token_at - self.submitted)


class Scheduler:
    """Owns one engine's cache rows; `submit` from any thread, the work runs on the scheduler's thread.

    max_batch: rows decoded together. max_queue: requests waiting for a row before submit raises
    QueueFullError. prefill_chunk: prompt tokens per prefill call (a longer prompt takes several).
    prefill_budget: prompt tokens prefilled between two decode steps (default 4 chunks; at least
    one chunk always runs): a lower budget keeps the running rows' inter-token latency flatter while
    prompts arrive, a higher one brings new requests' first tokens sooner."""

    def __init__(self, engine: Any, *, max_batch: int = 8, max_queue: int = 64, prefill_chunk: int = 64,
                 prefill_budget: int | None = None, rows: Rows | None = None):
        if max_queue < 0:
            raise InputError(f"max_queue must be >= 0, got {max_queue}")
        if prefill_chunk < 1:
            raise InputError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if prefill_budget is not None and prefill_budget < 1:
            raise InputError(f"prefill_budget must be >= 1, got {prefill_budget}")
        self.prefill_budget = 4 * prefill_chunk if prefill_budget is None else prefill_budget
        self.engine = engine
        self.rows = rows or rows_for(engine.session, max_batch)
        self.max_batch, self.max_queue, self.prefill_chunk = self.rows.rows, max_queue, prefill_chunk
        self.max_seq = engine.limit  # max_seq, or past it where every layer slides on a ring
        self.stats = Stats()
        self._queue: deque[Request] = deque()
        self._slots: list[Request | None] = [None] * self.max_batch
        self._cond = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._fatal: BaseException | None = None

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> Scheduler:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kvexport-scheduler", daemon=True)
            self._thread.start()
        return self

    def close(self, *, wait: bool = True, cancel: bool = False, timeout: float | None = None) -> None:
        """Stop admitting; the queued and running requests finish (or are cancelled with cancel=True)."""
        with self._cond:
            self._closing = True
            if cancel:
                for r in [*self._queue, *(s for s in self._slots if s is not None)]:
                    r.cancelled = True
            self._cond.notify_all()
        if wait and self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> Scheduler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close(cancel=exc[0] is not None)

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return sum(s is not None for s in self._slots)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # --- submit ---------------------------------------------------------------------------------
    def submit(self, prompt: Any, max_tokens: int = 16, *, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | None = None, stop: Sequence[int | str] = (),
               sink: Callable[[Event], None] | None = None, ignore_eos: bool = False) -> Request:
        """Queue a request; raises InputError / ContextOverflowError (bad or too long, before it is
        queued), QueueFullError, SchedulerClosedError. `sink` receives the Events on the scheduler's
        thread (it must not block); without it, iterate the returned Request. ignore_eos: generate
        max_tokens whatever the model says (benchmarks)."""
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise InputError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        params = SamplingParams(float(temperature), int(top_k), float(top_p), seed)
        ids = self.engine._as_ids(prompt)
        need = len(ids) + max_tokens
        if need > self.max_seq:
            raise ContextOverflowError(
                f"the request needs {need} cache slots (prompt {len(ids)} + max_tokens {max_tokens}) but this "
                f"engine holds at most max_seq={self.max_seq}; shorten the prompt or lower max_tokens")
        stop_ids = (set() if ignore_eos else set(self.engine.eos_ids)) | {int(s) for s in stop if isinstance(s, int)}
        stop_strings = [s for s in stop if isinstance(s, str) and s]
        req = Request(ids, max_tokens, params, stop_ids, stop_strings, sink)
        req._scheduler = self
        with self._cond:
            if self._fatal is not None:
                raise SchedulerClosedError(f"the scheduler stopped after an engine failure: {self._fatal}")
            if self._closing:
                self.stats.rejected["closing"] = self.stats.rejected.get("closing", 0) + 1
                raise SchedulerClosedError("the scheduler is shutting down and admits no new request")
            free = sum(s is None for s in self._slots)
            if len(self._queue) + 1 - free > self.max_queue:  # with this one, those beyond the free rows wait
                self.stats.rejected["queue_full"] = self.stats.rejected.get("queue_full", 0) + 1
                raise QueueFullError(f"{len(self._queue)} requests are waiting (max_queue={self.max_queue}); "
                                     "retry later")
            self._queue.append(req)
            self._cond.notify_all()
        if self._thread is None:
            self.start()
        return req

    def generate(self, prompt: Any, max_tokens: int = 16, **kw: Any) -> Result:
        """submit and wait for the result."""
        return self.submit(prompt, max_tokens, **kw).result()

    # --- the loop -------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    self._retire_cancelled()
                    self._admit()
                    busy = any(s is not None for s in self._slots)
                    if not busy:
                        if self._closing and not self._queue:
                            return
                        self._cond.wait(0.5)
                        continue
                self._prefill()
                self._decode_all()
        except BaseException as e:  # an engine failure outside one request: fail everyone, admit no more
            self._fatal = e
            with self._cond:
                for r in [*self._queue, *(s for s in self._slots if s is not None)]:
                    self._finish(r, "error", error=f"{type(e).__name__}: {e}")
                self._queue.clear()
                self._slots = [None] * self.max_batch
            raise
        finally:
            self.rows.release()

    def _retire_cancelled(self) -> None:
        for r in [r for r in self._queue if r.cancelled]:
            self._queue.remove(r)
            self._finish(r, "cancelled")
        for i, r in enumerate(self._slots):
            if r is not None and r.cancelled:
                self._finish(r, "cancelled")

    def _admit(self) -> None:
        while self._queue and None in self._slots:
            row = self._slots.index(None)  # the lowest free row: keeps the decoded prefix short
            r = self._queue.popleft()
            try:
                self.rows.reset(row, len(r.prompt_ids) + r.max_tokens)
            except Exception as e:  # noqa: BLE001 - this request fails, not the scheduler
                self._finish(r, "error", error=f"{type(e).__name__}: {e}")
                continue
            r.row = row
            self._slots[row] = r

    def _prefill(self) -> None:
        """Prefill chunks, earliest-admitted row first, until prefill_budget prompt tokens ran (at
        least one chunk) or no admitted row has prompt left."""
        spent = 0
        while spent < self.prefill_budget:
            waiting = [r for r in self._slots
                       if r is not None and not r.cancelled and r.prefilled < len(r.prompt_ids)]
            if not waiting:
                return
            spent += self._prefill_one(min(waiting, key=lambda x: x.id))

    def _prefill_one(self, r: Request) -> int:
        """One prefill chunk of r; returns its prompt tokens (a failed chunk counts as a whole one)."""
        assert r.row is not None
        chunk = r.prompt_ids[r.prefilled: r.prefilled + self.prefill_chunk]
        try:
            logits = self.rows.extend(r.row, np.asarray(chunk, dtype=np.int64))
            r.prefilled += len(chunk)
            self.stats.prefill_chunks += 1
            if r.prefilled == len(r.prompt_ids):
                self.stats.prompt_tokens += len(r.prompt_ids)
                self._take(r, logits[None, :])
        except Exception as e:  # noqa: BLE001
            self._finish(r, "error", error=f"{type(e).__name__}: {e}")
        return len(chunk)

    def _decode_all(self) -> None:
        live = [r for r in self._slots if r is not None and r.pending is not None and r.finish_reason is None]
        if not live:
            return
        live.sort(key=lambda x: x.row)  # type: ignore[arg-type, return-value]
        rows = np.array([r.row for r in live], dtype=np.int64)
        tokens = np.array([r.pending for r in live], dtype=np.int64)
        try:
            logits = self.rows.decode(rows, tokens)
        except Exception as e:  # noqa: BLE001 - the rows of this step fail; the scheduler goes on
            for r in live:
                self._finish(r, "error", error=f"{type(e).__name__}: {e}")
            return
        self.stats.steps += 1
        for j, r in enumerate(live):
            self._take(r, logits[j: j + 1])
        self.stats.record_step(time.monotonic(), len(live))

    # --- per request ----------------------------------------------------------------------------
    def _take(self, r: Request, logits: np.ndarray) -> None:
        """Sample r's next token from its logits (1, V), emit it, retire r if it is done."""
        try:
            t = int(sample(logits, r.params, r.rng)[0])
            now = time.monotonic()
            if r.first_token_at is None:
                r.first_token_at = now
                self.stats.ttft.observe(now - r.submitted)
            else:
                self.stats.itl.observe(now - (r.last_token_at or now))
            r.last_token_at = now
            self.stats.generated_tokens += 1
            r.token_ids.append(t)
            reason = "stop" if t in r.stop_ids else ("length" if len(r.token_ids) >= r.max_tokens else None)
            text = self.engine.decode_text(r.token_ids) or ""
            cut = _first_stop(text, r.stop_strings)
            if cut is not None:
                text, reason = text[:cut], "stop"
            r.text = text
            if reason is None:
                safe = len(text) - _held_back(text, r.stop_strings)
            else:
                safe = len(text)
            delta = text[r.emitted: safe] if safe > r.emitted else ""
            r.emitted = max(r.emitted, safe)
            r._sink(Event(t, delta, len(r.token_ids) - 1, None))
            if reason is not None:
                self._finish(r, reason)
            else:
                r.pending = t
        except Exception as e:  # noqa: BLE001 - a failing request never takes the others down
            self._finish(r, "error", error=f"{type(e).__name__}: {e}")

    def _finish(self, r: Request, reason: str, error: str | None = None) -> None:
        if r.finish_reason is not None and r.done:
            return
        r.finish_reason, r.error, r.pending = reason, error, None
        if r.row is not None and self._slots[r.row] is r:
            self._slots[r.row] = None
            self.rows.free(r.row)
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        tail = r.text[r.emitted:] if reason in ("stop", "length") else ""
        r.emitted = len(r.text)
        try:
            r._sink(Event(None, tail, len(r.token_ids), reason, error))
        except Exception:  # noqa: BLE001, S110 - a broken sink (client gone) must not stop the loop
            pass
        r._done.set()


def _first_stop(text: str, stops: list[str]) -> int | None:
    hits = [text.find(s) for s in stops]
    hits = [h for h in hits if h >= 0]
    return min(hits) if hits else None


def _held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of text to hold back: an incomplete UTF-8 character, or the longest
    suffix that begins one of the stop strings (it may turn into a stop, which is never sent)."""
    n = 0
    if text.endswith("\ufffd"):
        n = len(text) - len(text.rstrip("\ufffd"))
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                n = max(n, k)
                break
    return n
