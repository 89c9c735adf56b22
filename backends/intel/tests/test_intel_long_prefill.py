"""A long batch-1 prompt on the intel target is prefilled through the engine's paged-attention form and its K/V
handed to the request's state (kvexport_intel.session.PAGED_PREFILL_MIN): the logits and greedy tokens are the
one stateful call's, with f32, f16 and u8 caches, and the handed-over cache continues as the prompt would."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import kvexport
from kvexport.testing import greedy_logits
from kvexport.tolerances import tolerance

pytest.importorskip("openvino", reason="the intel target needs openvino (pip install 'kvexport[intel]')")

from kvexport_intel import session as intel_session  # noqa: E402

PROMPT, THRESHOLD, STEPS = 100, 40, 8  # four blocks of 32, the last one part full


def prompt_ids(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 259, n)]


@pytest.fixture
def threshold() -> Iterator[None]:
    saved, intel_session.PAGED_PREFILL_MIN = intel_session.PAGED_PREFILL_MIN, THRESHOLD
    yield
    intel_session.PAGED_PREFILL_MIN = saved


def both_paths(engine: kvexport.runtime.engine.Engine, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """greedy_logits of `ids` through one stateful call (threshold above the prompt), then the paged prefill."""
    saved = intel_session.PAGED_PREFILL_MIN
    intel_session.PAGED_PREFILL_MIN = len(ids) + 1
    try:
        old = greedy_logits(engine, ids, STEPS)
    finally:
        intel_session.PAGED_PREFILL_MIN = saved
    assert "long_prefill" not in engine.session.facts
    new = greedy_logits(engine, ids, STEPS)
    assert engine.session.facts["long_prefill"] == "paged attention, then the state"
    return old, new


@pytest.mark.parametrize("kv", ["f32", "f16", "u8"])
def test_paged_prefill_equals_one_stateful_call(intel_artifacts: dict, threshold: None, kv: str) -> None:
    _, art = intel_artifacts["llama"]
    engine = kvexport.load(str(art), precision="fp32", kv_precision=kv)
    ids = prompt_ids(PROMPT, seed=5)
    old, new = both_paths(engine, ids)
    gap = float(np.abs(old - new).max())
    assert gap <= tolerance("intel", "fp32").max_abs_logit, gap
    assert (old.argmax(-1) == new.argmax(-1)).all()
    if kv != "f32":  # the decode steps read the handed-over cache in f16/u8: not the f32 engine's logits
        f32 = greedy_logits(kvexport.load(str(art), precision="fp32"), ids, STEPS)
        assert np.abs(f32[1:] - new[1:]).max() > 10 * max(gap, 1e-6)


def test_paged_prefill_cache_continues(intel_artifacts: dict, threshold: None) -> None:
    """prefill(N) then decode(t) gives the logits prefill(N + t) gives, both through the paged prefill, and the
    request holds N + 1 slots after one engine call and one step."""
    _, art = intel_artifacts["llama"]
    engine = kvexport.load(str(art), precision="fp32")
    ids = prompt_ids(PROMPT + 1, seed=6)
    b = engine.prefill(ids[:-1], 2)
    assert b.state.steps == 1 and b.state.slots == PROMPT
    stepped = engine.decode(b, np.array([ids[-1]]))[0]
    assert b.state.slots == PROMPT + 1
    engine.session.release(b.state)
    whole = engine.prefill(ids, 1)
    gap = float(np.abs(whole.logits[0] - stepped).max())
    assert gap <= tolerance("intel", "fp32").max_abs_logit, gap


def test_batches_and_short_prompts_keep_the_stateful_call(intel_artifacts: dict, threshold: None) -> None:
    """A left-padded batch and a prompt under the threshold never reach the paged form."""
    _, art = intel_artifacts["llama"]
    engine = kvexport.load(str(art), precision="fp32")
    engine.session.prefill_model = None  # type: ignore[assignment]  # calling it would raise
    b = engine.prefill([prompt_ids(PROMPT, 1), prompt_ids(PROMPT - 7, 2)], 1)
    engine.session.release(b.state)
    b = engine.prefill(prompt_ids(THRESHOLD - 1, 3), 1)
    engine.session.release(b.state)
    assert "long_prefill" not in engine.session.facts
