"""A long prompt is prefilled in pieces of PREFILL_PIECE tokens (cpu at batch 1): the pieces give the logits
one call over the whole prompt gives, and the engine really takes several calls; the intel engine takes one."""
from __future__ import annotations

from pathlib import Path

import kvexport
from kvexport.testing import prefill_pieces_gap
from kvexport.tolerances import EXACT

from tests.conftest import random_ids

PROMPT, PIECE = 50, 16  # 4 pieces, the last one short


def test_cpu_prefill_in_pieces_matches_one_call(artifacts: dict[str, Path]) -> None:
    gap, calls = prefill_pieces_gap(kvexport.load(str(artifacts["llama"])), random_ids(PROMPT, seed=3), PIECE)
    assert calls == [1, 4]
    assert gap < EXACT.max_abs_logit, gap


def test_cpu_batch_prefill_stays_one_call(artifacts: dict[str, Path]) -> None:
    """GroupQueryAttention takes several new rows over a past at batch 1 only: a batch is not cut."""
    from kvexport.runtime import session

    engine = kvexport.load(str(artifacts["llama"]))
    saved, session.PREFILL_PIECE = session.PREFILL_PIECE, PIECE
    try:
        b = engine.prefill([random_ids(PROMPT, seed=1), random_ids(PROMPT - 9, seed=2)], 1)
        assert b.state.steps == 1
        engine.session.release(b.state)
    finally:
        session.PREFILL_PIECE = saved


def test_intel_prefill_stays_one_call(intel_builds: dict[str, Path]) -> None:
    """OpenVINO's fused attention with state took longer for a 4096-token prompt in pieces than in one call."""
    engine = kvexport.load(str(intel_builds["llama"]), precision="fp32")  # fp32 inference on AMX/AVX512-BF16 CPUs too
    gap, calls = prefill_pieces_gap(engine, random_ids(PROMPT, seed=3), PIECE)
    assert calls == [1, 1]
    assert gap < EXACT.max_abs_logit, gap
