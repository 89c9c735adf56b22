"""kvexport.runtime.sampling: top-k, top-p, temperature and seeds, over many draws with fixed seeds
(deterministic: these tests cannot flake)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvexport
from kvexport.errors import InputError
from kvexport.runtime.sampling import SamplingParams, sample

V, DRAWS = 64, 20000


def _logits(seed: int, rows: int = 1, scale: float = 2.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, V)) * scale).astype(np.float32)


def _draws(logits: np.ndarray, params: SamplingParams, seed: int = 0, n: int = DRAWS) -> np.ndarray:
    """n draws from one row of logits (the row repeated: one vectorized call)."""
    return sample(np.repeat(logits[:1], n, axis=0), params, np.random.default_rng(seed))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max())
    return e / e.sum()


@pytest.mark.parametrize("k", [1, 2, 5, 17])
def test_top_k_never_samples_outside_the_k_best(k: int) -> None:
    for seed in range(5):
        row = _logits(seed)
        best = set(np.argsort(-row[0])[:k].tolist())
        drawn = set(_draws(row, SamplingParams(temperature=1.5, top_k=k), seed).tolist())
        assert drawn <= best
        assert len(drawn) == k  # every one of the k is reachable


def test_top_k_with_ties_at_the_kth_keeps_exactly_k() -> None:
    row = np.full((1, V), -5.0, np.float32)
    row[0, [3, 9]] = 4.0
    row[0, [10, 20, 30, 40]] = 2.0  # four-way tie for the 3rd place
    drawn = set(_draws(row, SamplingParams(temperature=2.0, top_k=3)).tolist())
    assert {3, 9} <= drawn and len(drawn) == 3 and drawn <= {3, 9, 10, 20, 30, 40}


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.6, 0.9])
def test_top_p_never_samples_outside_the_nucleus(top_p: float) -> None:
    for seed in range(5):
        row = _logits(seed)
        p = _softmax(row[0] / 0.8)
        order = np.argsort(-p)
        before = np.cumsum(p[order]) - p[order]
        nucleus = set(order[before < top_p].tolist())  # the fewest most likely tokens reaching top_p
        drawn = _draws(row, SamplingParams(temperature=0.8, top_p=top_p), seed)
        assert set(drawn.tolist()) <= nucleus
        # inside the nucleus, the draws follow the renormalized probabilities
        q = np.zeros(V)
        q[list(nucleus)] = p[list(nucleus)]
        q /= q.sum()
        freq = np.bincount(drawn, minlength=V) / len(drawn)
        assert np.abs(freq - q).max() < 0.015


def test_top_k_and_top_p_together_sample_their_intersection() -> None:
    row = _logits(11)
    p = _softmax(row[0])
    top5 = np.argsort(-p)[:5]
    q = p[top5] / p[top5].sum()
    nucleus = set(top5[np.cumsum(q) - q < 0.7].tolist())
    drawn = set(_draws(row, SamplingParams(temperature=1.0, top_k=5, top_p=0.7)).tolist())
    assert drawn == nucleus


def test_temperature_draws_follow_the_softmax() -> None:
    row = _logits(3, scale=1.0)
    for t in (0.5, 1.0, 2.0):
        freq = np.bincount(_draws(row, SamplingParams(temperature=t), seed=1), minlength=V) / DRAWS
        assert np.abs(freq - _softmax(row[0] / t)).max() < 0.015


@pytest.mark.parametrize("t", [1e-4, 1e-8, 1e-30, 1e-300, 5e-324])
def test_a_tiny_temperature_is_greedy(t: float) -> None:
    logits = _logits(5, rows=500)
    greedy = sample(logits, SamplingParams(), np.random.default_rng(0))
    for seed in range(3):
        assert np.array_equal(sample(logits, SamplingParams(temperature=t), np.random.default_rng(seed)), greedy)
        assert np.array_equal(sample(logits, SamplingParams(temperature=t, top_p=0.5, top_k=7),
                                     np.random.default_rng(seed)), greedy)


class _EdgeRng:
    """A generator whose uniform draws sit at the ends of [0, 1)."""

    def __init__(self, u: float):
        self.u = u

    def random(self, shape: tuple[int, ...]) -> np.ndarray:
        return np.full(shape, self.u)


@pytest.mark.parametrize("u", [0.0, np.nextafter(1.0, 0.0)])
def test_draws_at_the_ends_of_the_unit_interval_stay_inside_the_kept_set(u: float) -> None:
    logits = _logits(8, rows=400, scale=3.0)
    for params in (SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=0.7, top_p=0.5)):
        got = sample(logits, params, _EdgeRng(u))  # type: ignore[arg-type]
        for row, tok in zip(logits, got):
            kept = sample(np.repeat(row[None], 2000, axis=0), params, np.random.default_rng(0))
            assert tok in set(kept.tolist()) | {int(row.argmax())}
            if params.top_k:
                assert tok in set(np.argsort(-row)[: params.top_k].tolist())


def test_a_seed_reproduces_and_different_seeds_differ() -> None:
    logits = _logits(2, rows=256, scale=0.5)
    params = SamplingParams(temperature=1.0, top_p=0.95)
    a = sample(logits, params, np.random.default_rng(1234))
    assert np.array_equal(a, sample(logits, params, np.random.default_rng(1234)))
    b = sample(logits, params, np.random.default_rng(1235))
    assert (a != b).mean() > 0.5


def test_engine_generate_seeds(artifacts: dict[str, Path]) -> None:
    engine = kvexport.load(artifacts["llama"])
    kw = {"max_new_tokens": 24, "temperature": 1.0, "top_p": 0.95}
    runs = {seed: engine.generate([5, 6, 7], seed=seed, **kw).token_ids for seed in (1, 2, 3)}
    assert engine.generate([5, 6, 7], seed=1, **kw).token_ids == runs[1]
    assert len({tuple(r) for r in runs.values()}) == 3
    streamed = [ev.token_id for ev in engine.stream([5, 6, 7], seed=2, **kw)]
    assert streamed == runs[2]


def test_bad_parameters_are_refused() -> None:
    for bad in ({"temperature": -0.1}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(InputError):
            SamplingParams(**bad)  # type: ignore[arg-type]
