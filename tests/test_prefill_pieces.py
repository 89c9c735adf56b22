"""A long prompt is prefilled in pieces of PREFILL_PIECE tokens (cpu at batch 1): the pieces give the logits
one call over the whole prompt gives, and the engine really takes several calls; the intel engine takes one."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvexport
from kvexport.runtime.engine import left_padded
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


@pytest.mark.parametrize("pad", [[0], [0, 0, 0], [2, 0], [0, 5, 1]])
def test_prompt_mask_is_the_causal_triangle_and_unpadded_rows_hold_no_s_by_s_bytes(pad: list[int]) -> None:
    """Engine.prefill's layout, checked element by element against the rule it states; an unpadded batch's mask is a
    read-only view of 2S - 1 bools (a 32,768-token prompt once filled 1 GiB of mask before its first piece ran)."""
    S = 7
    pos, mask = left_padded(np.array(pad, dtype=np.int64), S)
    assert mask.shape == (len(pad), S, S) and mask.dtype == np.bool_
    for b, p in enumerate(pad):
        for i in range(S):
            want = [(p <= j <= i) or (i == j < p) for j in range(S)]  # no pad key; a pad query sees itself
            assert mask[b, i].tolist() == want, (b, i)
        assert pos[b].tolist() == [max(i - p, 0) for i in range(S)]
    if not any(pad):
        assert span(mask) == 2 * S - 1 and not mask.flags.writeable
    pos, mask = left_padded(np.zeros(1, dtype=np.int64), 32768)
    assert span(mask) < 65536 and mask[0, 20000, 20000] and not mask[0, 20000, 20001] and mask[0, -1].all()


def span(a: np.ndarray) -> int:
    """Bytes between an array's first and last element, both included (numpy's byte_bounds, on numpy 1 and 2)."""
    return a.itemsize + sum((n - 1) * abs(st) for n, st in zip(a.shape, a.strides))
