"""A long batch-1 prompt on the intel target is prefilled through the engine's paged-attention form
(kvexport_intel.session.PAGED_PREFILL_MIN); with an f32 cache the request keeps decoding paged, with f16/u8 its K/V
is handed to the request's state. The logits and greedy tokens are the stateful path's with f32, f16 and u8 caches,
the cache continues as the prompt would (decode steps and later chunks), and a step paged attention cannot take
hands the blocks over to the state with the same logits."""
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
    f32 = engine.session.compile_config["KV_CACHE_PRECISION"] == "f32"
    assert engine.session.facts["long_prefill"] == ("paged attention, decode paged" if f32
                                                    else "paged attention, then the state")
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
    assert b.state.steps == 1 and b.state.slots == PROMPT and b.state.rows is not None  # the f32 cache stays paged
    assert engine.session.state_bytes(b.state) == stateful_bytes(engine, ids[:-1])
    stepped = engine.decode(b, np.array([ids[-1]]))[0]
    assert b.state.slots == PROMPT + 1 and b.state.rows is not None
    engine.session.release(b.state)
    assert b.state.rows is None
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


def stateful_bytes(engine: kvexport.runtime.engine.Engine, ids: list[int]) -> int:
    """state_bytes of `ids` prefilled in one stateful call."""
    saved, intel_session.PAGED_PREFILL_MIN = intel_session.PAGED_PREFILL_MIN, len(ids) + 1
    try:
        b = engine.prefill(ids, 1)
    finally:
        intel_session.PAGED_PREFILL_MIN = saved
    n = engine.session.state_bytes(b.state)
    engine.session.release(b.state)
    return n


def test_paged_request_takes_a_later_chunk(intel_artifacts: dict, threshold: None) -> None:
    """A chunk of several tokens after a paged prefill goes to the same blocks: its last logits are the whole
    prompt's."""
    _, art = intel_artifacts["llama"]
    engine = kvexport.load(str(art), precision="fp32")
    ids = prompt_ids(PROMPT + 5, seed=7)
    b = engine.prefill(ids[:PROMPT], 1)
    i = np.arange(PROMPT, PROMPT + 5)
    mask = np.arange(PROMPT + 5)[None, :] <= i[:, None]  # (5, PROMPT + 5): all of the past, causal among the five
    chunk = engine.session.step(b.state, np.array([ids[PROMPT:]]), i[None], mask[None, None])[0].copy()
    assert b.state.rows is not None and b.state.slots == PROMPT + 5
    engine.session.release(b.state)
    whole = engine.prefill(ids, 1)
    gap = float(np.abs(whole.logits[0] - chunk).max())
    assert gap <= tolerance("intel", "fp32").max_abs_logit, gap


def test_a_step_paged_attention_cannot_take_hands_over(intel_artifacts: dict, threshold: None) -> None:
    """A decode step that hides a held slot is not paged attention's: the blocks go to the state first, and the
    logits are those of the same step after one stateful prefill."""
    _, art = intel_artifacts["llama"]
    engine = kvexport.load(str(art), precision="fp32")
    ids = prompt_ids(PROMPT + 1, seed=8)
    mask = np.ones((1, 1, 1, PROMPT + 1), bool)
    mask[..., 3] = False  # the fourth prompt token hidden from the new one

    def hidden_step(long: bool) -> np.ndarray:
        saved = intel_session.PAGED_PREFILL_MIN
        intel_session.PAGED_PREFILL_MIN = THRESHOLD if long else PROMPT + 1
        try:
            b = engine.prefill(ids[:PROMPT], 2)
        finally:
            intel_session.PAGED_PREFILL_MIN = saved
        assert (b.state.rows is not None) == long
        out = engine.session.step(b.state, np.array([[ids[PROMPT]]]), np.array([[PROMPT]]), mask)[0].copy()
        assert b.state.rows is None and b.state.slots == PROMPT + 1
        engine.session.release(b.state)
        return out

    stateful, handed = hidden_step(False), hidden_step(True)
    gap = float(np.abs(stateful - handed).max())
    assert gap <= tolerance("intel", "fp32").max_abs_logit, gap
    seen = engine.prefill(ids, 1).logits[0]  # the same token seeing slot 3: the mask did change the logits
    assert float(np.abs(seen - handed).max()) > 10 * max(gap, 1e-6)
    assert int(stateful.argmax()) == int(handed.argmax())


def test_paged_form_splits_the_packed_projections(intel_artifacts: dict) -> None:
    """The paged form runs the IR's packed q|k|v and gate|up projections as one MatMul per piece (no VariadicSplit
    copy of every token's projection), with the packed form's logits."""
    import openvino as ov

    from kvexport_intel.paged import PagedRows, to_paged

    _, art = intel_artifacts["llama"]
    engine = kvexport.load(str(art), precision="fp32")
    layers = engine.session.num_layers
    core = ov.Core()

    def split_matmuls(model: ov.Model) -> int:
        return sum(op.get_type_name() == "VariadicSplit" and op.input_value(0).get_node().get_type_name() == "MatMul"
                   for op in model.get_ordered_ops())

    def matmuls(model: ov.Model) -> int:
        return sum(op.get_type_name() == "MatMul" for op in model.get_ordered_ops())

    logits, counts = [], []
    for split in (False, True):
        model = core.read_model(engine.session.model_path)
        assert to_paged(model, engine.session.windows, split_packed=split) is None
        assert split_matmuls(model) == (0 if split else 2 * layers)
        counts.append(matmuls(model))
        rows = PagedRows(core.compile_model(model, "CPU", engine.session.compile_config), rows=1, max_seq=PROMPT,
                         num_layers=layers, vocab_size=engine.vocab_size)
        logits.append(rows.extend(0, np.array(prompt_ids(PROMPT, seed=9))).copy())
    assert counts[1] == counts[0] + 3 * layers  # q|k|v into three, gate|up into two; no packed MatMul left running
    gap = float(np.abs(logits[0] - logits[1]).max())
    assert gap <= tolerance("intel", "fp32").max_abs_logit, gap
