"""The paged-attention form a long prompt takes is compiled when the engine loads (the load option paged_compile), so
the first long prompt's time to first token holds no compile; paged_compile=first_use defers it to that prompt."""
from __future__ import annotations

import numpy as np
import pytest

import kvexport
from kvexport.errors import InputError
from kvexport.testing import greedy_logits

pytest.importorskip("openvino", reason="the intel target needs openvino (pip install 'kvexport[intel]')")

from kvexport_intel.session import IntelSession  # noqa: E402

THRESHOLD, PROMPT = 40, 100  # the tiny llama's engine holds 128 slots


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Every compile of a paged form, by its config."""
    seen: list[dict] = []
    real = IntelSession._compile_paged

    def counted(self: IntelSession, config: dict, split: str, gemv: object = None) -> tuple:
        seen.append(config)
        return real(self, config, split, gemv)

    monkeypatch.setattr(IntelSession, "_compile_paged", counted)
    return seen


def long_prompt(engine: kvexport.runtime.engine.Engine) -> np.ndarray:
    ids = [int(t) for t in np.random.default_rng(3).integers(3, 259, PROMPT)]
    logits = greedy_logits(engine, ids, 2)
    assert engine.session.facts["long_prefill"] == "paged attention, decode paged"
    return logits


def test_the_paged_form_is_compiled_at_load(intel_artifacts: dict, compiles: list[dict]) -> None:
    _, art = intel_artifacts["llama"]
    engine = kvexport.load(str(art), precision="fp32", paged_prefill_min=THRESHOLD)
    assert len(compiles) == 1 and engine.session.facts["paged_compile"] == "at load"
    at_load = long_prompt(engine)
    assert len(compiles) == 1  # the long prompt found it compiled
    later = kvexport.load(str(art), precision="fp32", paged_prefill_min=THRESHOLD, paged_compile="first_use")
    assert len(compiles) == 1 and later.session.facts["paged_compile"].startswith("on first use")
    np.testing.assert_array_equal(long_prompt(later), at_load)  # the same compiled form, only sooner
    assert len(compiles) == 2


def test_no_compile_at_load_where_no_prompt_takes_the_paged_form(intel_artifacts: dict, compiles: list[dict]) -> None:
    _, art = intel_artifacts["llama"]
    engine = kvexport.load(str(art), precision="fp32", paged_prefill_min=1000)  # a threshold above its 128 slots
    assert compiles == []
    assert engine.session.facts["paged_compile"] == "on first use (no prompt this engine holds takes the paged form)"


def test_paged_compile_takes_load_or_first_use(intel_artifacts: dict, compiles: list[dict]) -> None:
    _, art = intel_artifacts["llama"]
    with pytest.raises(InputError, match="paged_compile is one of load, first_use"):
        kvexport.load(str(art), paged_compile="soon")
    assert compiles == []
