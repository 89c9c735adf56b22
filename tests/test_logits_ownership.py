"""Logits the API returns belong to the caller: every step's array, kept without .copy() over a long
decode, still equals transformers' logits for that position."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvexport
from kvexport.tolerances import tolerance
from tests.conftest import HFReference, random_ids

PROMPT, STEPS = 9, 56  # 65 slots of the fixtures' 128


def _kept_logits(engine: kvexport.runtime.engine.Engine, prompt: list[int]) -> tuple[list[int], list[np.ndarray]]:
    """Greedy decode keeping every returned array as is (no .copy())."""
    batch = engine.prefill(prompt, STEPS)
    kept = [batch.logits]
    tokens: list[int] = []
    for _ in range(STEPS):
        tokens.append(int(kept[-1][0].argmax()))
        kept.append(engine.decode(batch, np.array([tokens[-1]])))
    assert batch.logits is kept[-1]
    return tokens, kept


def _check_against_transformers(engine: kvexport.runtime.engine.Engine, ref: HFReference, backend: str) -> None:
    prompt = random_ids(PROMPT, seed=3)
    tokens, kept = _kept_logits(engine, prompt)
    assert len({id(k) for k in kept}) == len(kept)  # a new array every step
    assert not any(np.shares_memory(a, b) for a, b in zip(kept, kept[1:]))
    want = ref.logits(prompt + tokens)[PROMPT - 1:]  # (STEPS + 1, V): logits of each position
    got = np.concatenate(kept)
    worst = float(np.abs(got - want).max())
    print(f"{backend}: {len(kept)} kept logits arrays, max |engine - transformers| {worst:.2e}")
    assert worst <= tolerance(backend, "fp32").max_abs_logit


def test_cpu_logits_kept_without_copy_match_transformers(artifacts: dict[str, Path], references: dict) -> None:
    _check_against_transformers(kvexport.load(artifacts["llama"]), references["llama"], "cpu")


def test_intel_logits_kept_without_copy_match_transformers(intel_builds: dict[str, Path], references: dict) -> None:
    engine = kvexport.load(intel_builds["llama"], precision="fp32")
    _check_against_transformers(engine, references["llama"], "intel")


@pytest.mark.parametrize("target", ["cpu", "intel"])
def test_copy_false_is_a_view_the_next_step_overwrites(target: str, artifacts: dict[str, Path],
                                                       intel_builds: dict[str, Path]) -> None:
    engine = (kvexport.load(artifacts["llama"]) if target == "cpu"
              else kvexport.load(intel_builds["llama"], precision="fp32"))
    batch = engine.prefill(random_ids(5), 4, copy=False)
    view = batch.logits
    assert view is not None
    first = view.copy()
    owned = engine.decode(batch, first.argmax(-1))
    assert not np.shares_memory(owned, view)
    assert not np.array_equal(view, first)  # the view now shows the step after it
    np.testing.assert_array_equal(view, owned)
    kept = owned.copy()
    engine.decode(batch, owned.argmax(-1), copy=False)
    np.testing.assert_array_equal(owned, kept)  # the owned array is left alone by later steps
