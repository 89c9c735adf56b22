"""Batched rows on the intel target (kvexport_intel.paged, OpenVINO paged attention): every row gets what
its prompt gets alone through the stateful engine, rows joining at different steps and prefilled in
chunks while others decode; a retired row's blocks serve the next request."""
from __future__ import annotations

from pathlib import Path

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


# gemma2 caps its attention scores (softcap), which it computes by matmul and softmax, not SDPA: the
# transformation finds no attention to page. Sliding-window layers keep rings in the state by default, which
# it does not page either (test_paged_rows_of_full_length_sliding_layers builds them full length).
NOT_PAGED = {"gemma2": "sliding-window layers keep window-sized rings", "mistral": "ring_cache=false",
             "starcoder2": "ring_cache=false", "gemma3_text": "ring_cache=false"}


def prompt_ids(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 259, n)]


@pytest.fixture(scope="module")
def mistral_full_length(intel_workdir: Path, intel_artifacts: dict) -> Path:
    """The tiny mistral (window 24) built with --option ring_cache=false: its sliding layers full length."""
    from kvexport.backends import BuildOptions
    from kvexport.build import build

    ckpt, _ = intel_artifacts["mistral"]
    return build(ckpt, intel_workdir / "mistral-full-intel.kvx", target="intel", max_seq=128, verify=False,
                 options=BuildOptions(extra={"ring_cache": "false"}))


def staggered_equal_alone(engine: kvexport.runtime.engine.Engine) -> None:
    """Four prompts enter rows 1, 3, 0, 5 of 6 at different steps, in chunks of 4 tokens while the others
    decode: each row's logits stay within the fp32 tolerance of the stateful engine alone and pick the same
    greedy tokens (40 + 39 tokens held: past a sliding window of 24 or 16)."""
    rows = rows_for(engine.session, 6)
    assert isinstance(rows, PagedRows) and engine.session.facts["batch_rows"] == "paged attention"
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


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_paged_rows_staggered_equal_alone(family: str, intel_artifacts: dict) -> None:
    """Where paged attention does not apply the scheduler keeps one InferRequest per row, and the session
    says why."""
    _, art = intel_artifacts[family]
    engine = kvexport.load(str(art), precision="fp32")
    if family in NOT_PAGED:
        rows = rows_for(engine.session, 6)
        assert isinstance(rows, StateRows) and NOT_PAGED[family] in engine.session.facts["batch_rows"]
        return
    staggered_equal_alone(engine)


def test_paged_rows_of_full_length_sliding_layers(mistral_full_length: Path) -> None:
    """Built with ring_cache=false, mistral's sliding layers are full length and fused, and page: each gets
    its window on the paged op (the transformation leaves sliding_window at 0)."""
    engine = kvexport.load(str(mistral_full_length), precision="fp32")
    assert engine.manifest.target["ring"] is None and engine.limit == engine.max_seq
    assert engine.manifest.target["fingerprint"]["fused_attention_layers"] == engine.config.num_hidden_layers
    staggered_equal_alone(engine)


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
    engine = kvexport.load(str(art), paged_compile="first_use")  # compiled at load, the broken config would not apply
    engine.session.compile_config = {**engine.session.compile_config, "INFERENCE_PRECISION_HINT": "u1"}
    assert isinstance(rows_for(engine.session, 2), StateRows)
    assert engine.session.facts["batch_rows"].startswith(
        "one InferRequest per row: OpenVINO could not compile the paged model: Wrong value u1")


@pytest.mark.parametrize("kv, dtype", [("u8", np.uint8), ("f16", np.float16), ("i8", np.int8)])
def test_lossy_cache_rows_are_paged_each_as_alone(intel_artifacts: dict, kv: str, dtype: type) -> None:
    """A u8, f16 or i8 cache's rows run through paged attention too, its blocks in the cache's type (u8 quantized by
    paged attention's own scheme, i8 by kvexport's op, which `kvexport verify` judges through the long-prompt path):
    staggered rows get what each prompt gets in a row of its own on the same blocks, and stay within the cache's row
    of the stateful engine with the same cache (i8's: u8) in greedy tokens while they agree (random weights: near-ties part the greedy paths;
    the cache's quality is judged on the trained default model)."""
    _, art = intel_artifacts["llama"]
    engine = kvexport.load(str(art), precision="fp32", kv_precision=kv)
    rows = rows_for(engine.session, 4)
    assert isinstance(rows, PagedRows) and engine.session.facts["batch_rows"] == "paged attention"
    assert {c.dtype for c in rows.caches} == {np.dtype(dtype)}
    prompts = [prompt_ids(n, seed=n) for n in (5, 17, 40)]
    n_new = 40
    got = run_staggered(rows, prompts, n_new, where=[1, 3, 0], chunk=4)
    rows.release()
    for i, prompt in enumerate(prompts):
        one = rows_for(engine.session, 1)
        alone = run_staggered(one, [prompt], n_new, where=[0], chunk=4)[0]
        one.release()
        assert np.abs(got[i] - alone).max() <= tolerance("intel", "fp32").max_abs_logit, i
        assert (got[i].argmax(-1) == alone.argmax(-1)).all(), i
        ref = greedy_logits(engine, prompt, n_new)
        same = int(np.argmin(np.append(ref.argmax(-1) == got[i].argmax(-1), False)))  # steps on one token path
        assert same >= 1 and np.abs(ref[:same] - got[i][:same]).max() < 0.1, (i, same)


def test_one_token_steps_on_bound_inputs_equal_fresh_ones(intel_artifacts: dict) -> None:
    """Decode steps write their inputs into buffers bound to the request once (rebound where the rows' count or
    blocks change) instead of handing infer() fresh arrays each step: the same logits exactly, rows joining at
    different steps and crossing block boundaries, and the bound views follow the rows' blocks."""
    _, art = intel_artifacts["llama"]
    engine = kvexport.load(str(art), precision="fp32")
    prompts = [prompt_ids(n, seed=n) for n in (5, 30, 40)]  # 30 + 40 new tokens: into a third block of 32
    got, bound = [], []
    for bind in (False, True):
        rows = rows_for(engine.session, 4)
        rows.bind_one_token_steps = bind
        got.append(run_staggered(rows, prompts, 40, where=[2, 0, 3], chunk=7))
        bound.append(rows._bound)
        rows.release()
    assert bound[0] is None and bound[1] is not None
    for fresh, kept in zip(*got):
        assert np.array_equal(np.asarray(fresh), np.asarray(kept))


@pytest.mark.parametrize("slices", [1, 2])
def test_each_last_token_slice_becomes_a_gather_of_each_sequences_last_row(slices: int) -> None:
    """The paged layout holds tokens as rows (T, 1, hidden), where x[:, -1:] keeps them all: an artifact's single
    head slice (built before the last layer took the last row alone) or the last layer's pair of slices each becomes
    a gather of rows subsequence_begins[1:] - 1. A model made here: (T, 1, 4) rows of two sequences, 2 and 3 tokens."""
    import openvino as ov
    import openvino.opset13 as opset

    from kvexport_intel.paged import _last_token_logits

    x = opset.parameter([-1, 1, 4], np.float32, name="x")
    begins = opset.parameter([-1], np.int32, name="subsequence_begins")
    begins.output(0).get_tensor().set_names({"subsequence_begins"})

    def last(t: object) -> object:
        return opset.slice(t, np.array([-1]), np.array([2**63 - 1]), np.array([1]), np.array([1]))

    kept = last(x) if slices == 1 else opset.add(last(x), last(opset.relu(x)))
    other = opset.slice(x, np.array([0]), np.array([1]), np.array([1]), np.array([2]))  # not the last token's
    w = np.arange(16, dtype=np.float32).reshape(4, 4)
    model = ov.Model([opset.matmul(kept, w, False, False), other], [x, begins])
    assert _last_token_logits(model) == slices
    rows = np.random.default_rng(0).standard_normal((5, 1, 4)).astype(np.float32)
    compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})  # bf16 where the CPU has it
    out = compiled({"x": rows, "subsequence_begins": np.array([0, 2, 5], np.int32)})
    pick = rows[[1, 4]]
    want = (pick if slices == 1 else pick + np.maximum(pick, 0)) @ w
    np.testing.assert_allclose(out[0], want, rtol=1e-6)
    assert out[1].shape == (5, 1, 1)  # a slice of another axis left as it was
