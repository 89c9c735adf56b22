"""Continuous batching (kvexport/runtime/scheduler.py, rows.py): every request under concurrency gets
exactly what it gets alone; rows are reused; cancel, stop strings, queue and overflow limits."""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

import kvexport
from kvexport.runtime.engine import Engine
from kvexport.errors import ContextOverflowError, InputError
from kvexport.runtime.rows import BoundRows, StateRows
from kvexport.runtime.scheduler import QueueFullError, Scheduler, SchedulerClosedError
from kvexport.testing import greedy_logits, run_staggered

from tests.conftest import random_ids

TIMEOUT = 60

PROMPTS = ["hello world", "def main(", "a" * 70, "The quick brown fox", "x", "import numpy as np\n", "zzz",
           "class A:\n    pass"]
SAMPLING = [{}, {"temperature": 0.8, "seed": 3}, {"temperature": 1.0, "top_p": 0.9, "seed": 5}, {},
            {"temperature": 0.5, "seed": 11}, {"top_k": 5, "temperature": 1.0, "seed": 1},
            {"temperature": 1.2, "seed": 2}, {}]


@pytest.fixture(scope="module")
def engine(artifacts: dict[str, Path]) -> Engine:
    return kvexport.load(artifacts["llama"])


@pytest.fixture(scope="module")
def mistral(artifacts: dict[str, Path]) -> Engine:
    return kvexport.load(artifacts["mistral"])  # sliding window 24: the rows' masks slide too


@pytest.mark.parametrize("kind", ["bound", "state"])
@pytest.mark.parametrize("chunk", [64, 4])
@pytest.mark.parametrize("model", ["engine", "mistral"])
def test_rows_staggered_equal_alone(kind: str, chunk: int, model: str, request: pytest.FixtureRequest) -> None:
    """Rows admitted at different steps, out of row order, prefilled in chunks while others decode:
    each row's logits are the ones its prompt gets alone (greedy), past the sliding window too."""
    engine = request.getfixturevalue(model)
    prompts = [random_ids(n, seed=n) for n in (5, 17, 30, 9)]
    n_new = 40
    ref = [greedy_logits(engine, p, n_new) for p in prompts]
    cls = BoundRows if kind == "bound" else StateRows
    rows = cls(engine.session, 6)
    got = run_staggered(rows, prompts, n_new, where=[1, 3, 0, 5], chunk=chunk)
    rows.release()
    for i in range(4):
        g = got[i]
        np.testing.assert_allclose(g, ref[i], atol=1e-4, rtol=0)
        assert (g.argmax(-1) == ref[i].argmax(-1)).all()
        if chunk == 64:  # the whole prompt in one step: the same numbers as alone
            assert np.array_equal(g, ref[i]), f"row {i}: max diff {np.abs(g - ref[i]).max()}"


@pytest.mark.parametrize("kind", ["bound", "state"])
def test_scheduler_matches_alone(engine: Engine, kind: str) -> None:
    """8 requests (greedy and seeded sampling) through 3 rows: rows are reused, prompts longer than a
    chunk enter in pieces, and every request's tokens and text equal Engine.generate alone."""
    alone = [engine.generate(p, 30, **k) for p, k in zip(PROMPTS, SAMPLING)]
    rows = BoundRows(engine.session, 3) if kind == "bound" else StateRows(engine.session, 3)
    with Scheduler(engine, rows=rows, prefill_chunk=16) as s:
        hs = [s.submit(p, 30, **k) for p, k in zip(PROMPTS, SAMPLING)]
        res = [h.result(timeout=TIMEOUT) for h in hs]
        assert s.stats.prefill_chunks > len(PROMPTS)  # the 70-char prompt took several chunks
    for a, r in zip(alone, res):
        assert r.token_ids == a.token_ids
        assert r.text == a.text
        assert r.finish_reason == a.finish_reason
    assert s.running == 0 and s.queue_depth == 0


def test_streamed_text_and_stop_string(engine: Engine) -> None:
    """The streamed deltas add up to the result's text; a stop string ends the request and is never
    sent, not even its first characters."""
    full = engine.generate("hello world", 30).text
    assert full and len(full) > 8
    stop = full[5:8]
    want = full[: full.index(stop)]
    with Scheduler(engine, max_batch=2) as s:
        h = s.submit("hello world", 30, stop=[stop])
        events = list(h.events(timeout=TIMEOUT))
    assert "".join(ev.text for ev in events) == want
    assert h.result().text == want and h.result().finish_reason == "stop"
    assert events[-1].finish_reason == "stop" and all(ev.finish_reason is None for ev in events[:-1])


def test_cancel_frees_the_row(engine: Engine) -> None:
    """A cancelled request ends with finish_reason 'cancelled' and its row serves the next request,
    whose output equals what it gets alone."""
    alone = engine.generate("def main(", 20)
    with Scheduler(engine, max_batch=1, max_queue=4) as s:
        long = s.submit("x", 100)
        nxt = s.submit("def main(", 20)  # waits for the only row
        first = next(iter(long.events(timeout=TIMEOUT)))
        assert first.token_id is not None
        long.cancel()
        assert long.result(timeout=TIMEOUT).finish_reason == "cancelled"
        assert len(long.token_ids) < 100
        assert nxt.result(timeout=TIMEOUT).token_ids == alone.token_ids
    assert s.stats.finished.get("cancelled") == 1


def test_limits_refused_before_admission(engine: Engine) -> None:
    with Scheduler(engine, max_batch=1, max_queue=1) as s:
        with pytest.raises(ContextOverflowError, match="max_seq"):
            s.submit("a" * 100, engine.max_seq)
        with pytest.raises(InputError, match="max_tokens"):
            s.submit("a", 0)
        with pytest.raises(InputError, match="top_p"):
            s.submit("a", 4, temperature=1.0, top_p=0.0)
        a = s.submit("a", 100)  # takes the row
        b = s.submit("b", 100)  # waits (max_queue=1)
        with pytest.raises(QueueFullError, match="max_queue=1"):
            s.submit("c", 4)
        a.cancel()
        b.cancel()
    assert s.stats.rejected == {"queue_full": 1}


def test_max_queue_zero_runs_what_finds_a_row_and_refuses_what_would_wait(engine: Engine) -> None:
    """max_queue=0: no request waits. One that finds a free row is admitted (it was refused on an idle
    scheduler before); one that would have to wait for a row answers QueueFullError."""
    with Scheduler(engine, max_batch=1, max_queue=0) as s:
        a = s.submit("a", 100)  # the idle scheduler's free row
        with pytest.raises(QueueFullError, match="max_queue=0"):
            s.submit("b", 4)  # the row is taken: it would wait
        a.cancel()
        assert a.result(timeout=TIMEOUT).finish_reason == "cancelled"
        done = s.submit("c", 3).result(timeout=TIMEOUT)  # the row is free again
        assert len(done.token_ids) == 3
    assert s.stats.rejected == {"queue_full": 1}


def test_close_drains_and_refuses(engine: Engine) -> None:
    s = Scheduler(engine, max_batch=2).start()
    hs = [s.submit(p, 12) for p in PROMPTS[:4]]
    s.close(wait=True, timeout=TIMEOUT)
    assert [h.result(timeout=1).finish_reason for h in hs] == ["length"] * 4
    with pytest.raises(SchedulerClosedError):
        s.submit("a", 4)


def test_failing_request_leaves_others_alone(engine: Engine) -> None:
    """A request whose consumer fails on its first token ends with 'error'; the others are untouched."""
    alone = [engine.generate(p, 16) for p in PROMPTS[:3]]

    def broken(_ev: object) -> None:
        raise RuntimeError("consumer went away")

    with Scheduler(engine, max_batch=4) as s:
        bad = s.submit("zzz", 16, sink=broken)
        good = [s.submit(p, 16) for p in PROMPTS[:3]]
        assert [g.result(timeout=TIMEOUT).token_ids for g in good] == [a.token_ids for a in alone]
        bad._done.wait(TIMEOUT)
    assert bad.finish_reason == "error" and "consumer went away" in (bad.error or "")


def test_threads_submit_concurrently(engine: Engine) -> None:
    """Submitting from many threads at once: no request is lost or mixed with another."""
    alone = {p: engine.generate(p, 10).token_ids for p in PROMPTS}
    out: dict[int, list[int]] = {}
    with Scheduler(engine, max_batch=4, max_queue=64) as s:
        def one(i: int) -> None:
            out[i] = s.submit(PROMPTS[i % len(PROMPTS)], 10).result(timeout=TIMEOUT).token_ids

        ts = [threading.Thread(target=one, args=(i,)) for i in range(16)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(TIMEOUT)
    assert {i: out[i] for i in range(16)} == {i: alone[PROMPTS[i % len(PROMPTS)]] for i in range(16)}


@pytest.mark.parametrize(("budget", "all_in_first"), [(16, False), (400, True)])
def test_prefill_budget(engine: Engine, budget: int, all_in_first: bool) -> None:
    """Four requests arrive together, each prompt two chunks long. A budget of one chunk prefills one
    chunk between two decode steps (the first rows decode while the last prompts still enter); a
    budget covering all four prompts prefills them all before the first decode step, so every decode
    step serves every row. Either way each request gets what it gets alone."""
    prompts = [engine._as_ids(p * 20)[:20] for p in ("def f", "import", "x = 1", "class")]  # 2 chunks of 16
    alone = [engine.generate(p, 12) for p in prompts]
    s = Scheduler(engine, max_batch=4, prefill_chunk=16, prefill_budget=budget)
    with s._cond:  # queue all four before the loop's first admission (submit's lock is re-entrant)
        hs = [s.submit(p, 12) for p in prompts]
    with s:
        res = [h.result(timeout=TIMEOUT) for h in hs]
    assert [r.token_ids for r in res] == [a.token_ids for a in alone]
    assert s.stats.prefill_chunks == 8
    # 11 decode steps make the 11 tokens after each prompt's first; a one-chunk budget needs more
    assert (s.stats.steps == 11) is all_in_first, s.stats.steps
