"""Batched rows on the intel target (kvexport_intel.paged, OpenVINO paged attention): every row gets what
its prompt gets alone through the stateful engine, rows joining at different steps and prefilled in
chunks while others decode; a retired row's blocks serve the next request."""
from __future__ import annotations

import numpy as np
import pytest

import kvexport
from kvexport.runtime.rows import StateRows, rows_for
from kvexport.testing import greedy_logits, run_staggered
from kvexport.tolerances import tolerance
from kvexport.verify import compare
from kvexport.zoo import TINY_CONFIGS

pytest.importorskip("openvino", reason="the intel target needs openvino (pip install 'kvexport[intel]')")

from kvexport_intel.paged import PagedRows  # noqa: E402


# gemma2 caps its attention scores (softcap), which it computes by matmul and softmax, not SDPA:
# the transformation finds no attention to page.
NOT_PAGED = {"gemma2": "No ScaledDotProductAttention operation observed in the graph"}


def prompt_ids(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 259, n)]


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_paged_rows_staggered_equal_alone(family: str, intel_artifacts: dict) -> None:
    """Four prompts enter rows 1, 3, 0, 5 of 6 at different steps, in chunks of 4 tokens while the
    others decode: each row's logits stay within the fp32 tolerance of the stateful engine alone and
    pick the same greedy tokens, past the sliding window of mistral, starcoder2 and gemma3_text's
    sliding layers (window 24 / 16; 40 + 39 tokens held). Where paged attention does not apply the
    scheduler keeps one InferRequest per row, and the session says why."""
    _, art = intel_artifacts[family]
    engine = kvexport.load(str(art), precision="fp32")
    rows = rows_for(engine.session, 6)
    why = engine.session.facts["batch_rows"]
    if family in NOT_PAGED:
        assert isinstance(rows, StateRows) and NOT_PAGED[family] in why
        return
    assert isinstance(rows, PagedRows) and why == "paged attention"
    prompts = [prompt_ids(n, seed=n) for n in (5, 17, 40, 9)]  # 40: two blocks of 32
    n_new = 40
    ref = [greedy_logits(engine, p, n_new) for p in prompts]
    got = run_staggered(rows, prompts, n_new, where=[1, 3, 0, 5], chunk=4)
    assert rows.blocks_held() == sum(-(-(len(p) + n_new - 1) // rows.block) for p in prompts)
    rows.release()
    tol = tolerance("intel", "fp32")
    for i in range(4):
        stats = compare(ref[i], got[i])
        assert stats["max_abs_logit"] <= tol.max_abs_logit, (i, stats)
        assert (got[i].argmax(-1) == ref[i].argmax(-1)).all()


def test_retired_rows_blocks_serve_the_next_request(intel_artifacts: dict) -> None:
    """A request retired mid-way (cancelled) returns its blocks; the next request, in another row,
    takes the same blocks, still holding the old K/V, and gets exactly what it gets alone."""
    _, art = intel_artifacts["llama"]
    engine = kvexport.load(str(art), precision="fp32")
    rows = rows_for(engine.session, 2)
    assert isinstance(rows, PagedRows)
    rows.reset(0, 100)
    rows.extend(0, np.array(prompt_ids(70, seed=1)))  # 3 blocks
    rows.decode(np.array([0]), np.array([7]))
    taken = list(rows.tables[0])
    assert len(taken) == 3 and rows.blocks_held() == 3
    rows.free(0)  # the scheduler retires the cancelled request
    assert rows.blocks_held() == 0 and rows.held[0] == 0
    prompt = prompt_ids(50, seed=2)
    ref = greedy_logits(engine, prompt, 20)
    got = run_staggered(rows, [prompt], 20, where=[1], chunk=64)[0]
    assert rows.tables[1] == taken  # the freed blocks, in the order the retired row held them
    stats = compare(ref, got)
    assert stats["max_abs_logit"] <= tolerance("intel", "fp32").max_abs_logit, stats
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    rows.release()


def test_batch_rows_state_option_keeps_one_request_per_row(intel_artifacts: dict) -> None:
    _, art = intel_artifacts["llama"]
    engine = kvexport.load(str(art), batch_rows="state")
    assert isinstance(rows_for(engine.session, 2), StateRows)
    assert engine.session.facts["batch_rows"] == "one InferRequest per row: batch_rows=state was asked for"


def test_a_paged_model_openvino_cannot_compile_falls_back_with_the_reason(intel_artifacts: dict) -> None:
    _, art = intel_artifacts["llama"]
    engine = kvexport.load(str(art))
    engine.session.compile_config = {**engine.session.compile_config, "INFERENCE_PRECISION_HINT": "u1"}
    assert isinstance(rows_for(engine.session, 2), StateRows)
    assert engine.session.facts["batch_rows"].startswith(
        "one InferRequest per row: OpenVINO could not compile the paged model: Wrong value u1")
