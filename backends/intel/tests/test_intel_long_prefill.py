"""A long prompt on the intel target, one row or a left-padded batch, is prefilled through the engine's
paged-attention form (the load option paged_prefill_min, kvexport_intel.session.PAGED_PREFILL_MIN by default) and the
request keeps decoding paged, its blocks in the engine's cache precision (a batch's: a row each, without its padding). The logits and greedy tokens are the stateful path's with f32 and f16 caches;
a u8 cache's blocks are quantized by paged attention's own scheme, so its logits are close to the stateful u8 path's
and the f32 engine's, within the u8 cache's tolerance row. The cache continues as the prompt would (decode steps and
later chunks), and a step paged attention cannot take moves the request to the state with the stateful path's
logits."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import numpy as np
import pytest

import kvexport
from kvexport.testing import greedy_logits
from kvexport.errors import InputError
from kvexport.tolerances import Tolerance, tolerance
from kvexport.verify import compare

pytest.importorskip("openvino", reason="the intel target needs openvino (pip install 'kvexport[intel]')")

from kvexport_intel import session as intel_session  # noqa: E402

PROMPT, THRESHOLD, STEPS = 100, 40, 8  # four blocks of 32, the last one part full


def prompt_ids(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 259, n)]


def load(art: object, **options: object) -> kvexport.runtime.engine.Engine:
    """The engine with long prompts from THRESHOLD tokens on (the load option, not the module's default)."""
    return kvexport.load(str(art), precision="fp32", paged_prefill_min=THRESHOLD, **options)


@contextmanager
def stateful(engine: kvexport.runtime.engine.Engine, prompt: int) -> Iterator[None]:
    """Prompts of `prompt` tokens take one stateful call meanwhile (the threshold above them)."""
    saved, engine.session.paged_prefill_min = engine.session.paged_prefill_min, prompt + 1
    try:
        yield
    finally:
        engine.session.paged_prefill_min = saved


def both_paths(engine: kvexport.runtime.engine.Engine, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """greedy_logits of `ids` through one stateful call (threshold above the prompt), then the paged prefill."""
    with stateful(engine, len(ids)):
        old = greedy_logits(engine, ids, STEPS)
    assert "long_prefill" not in engine.session.facts
    new = greedy_logits(engine, ids, STEPS)
    assert engine.session.facts["long_prefill"] == "paged attention, decode paged"
    return old, new


def within_row(ref: np.ndarray, got: np.ndarray, row: Tolerance) -> dict[str, float]:
    """compare(ref, got), asserted inside a lossy row's top-1 and mean-KL bounds."""
    c = compare(ref, got)
    assert c["greedy_agreement"] >= row.min_top1_agreement and c["mean_kl"] <= row.max_mean_kl, c
    return c


def test_paged_prefill_equals_one_stateful_call(intel_artifacts: dict) -> None:
    _, art = intel_artifacts["llama"]
    engine = load(art)
    old, new = both_paths(engine, prompt_ids(PROMPT, seed=5))
    gap = float(np.abs(old - new).max())
    assert gap <= tolerance("intel", "fp32").max_abs_logit, gap
    assert (old.argmax(-1) == new.argmax(-1)).all()


@pytest.mark.parametrize("kv, dtype, row", [("f16", np.float16, "fp32+kv-fp16"), ("u8", np.uint8, "fp32+kv-int8")])
def test_paged_lossy_cache_is_close_to_the_stateful_one(intel_artifacts: dict, kv: str, dtype: type,
                                                        row: str) -> None:
    """The blocks are in the cache's own type (the f32 engine's logits move) and paged attention's own kernels and
    u8 blocks do not reproduce the stateful path's logits; both stay within the cache's row of
    the f32 engine and of each other."""
    _, art = intel_artifacts["llama"]
    engine = load(art, kv_precision=kv)
    ids = prompt_ids(PROMPT, seed=5)
    old, new = both_paths(engine, ids)
    b = engine.prefill(ids, 2)
    assert {c.dtype for c in b.state.rows.caches} == {np.dtype(dtype)}  # a u8 block holds its scales too
    engine.session.release(b.state)
    f32 = greedy_logits(load(art), ids, STEPS)
    within_row(old, new, tolerance("intel", row))
    within_row(f32, new, tolerance("intel", row))
    assert (f32.argmax(-1) == new.argmax(-1)).all()
    assert np.abs(f32[1:] - new[1:]).max() > 1e-4  # the decode steps read rounded blocks
    if kv == "u8":
        assert np.abs(old[1:] - new[1:]).max() > 1e-3  # quantized otherwise than the state


def test_paged_u8_cache_continues(intel_artifacts: dict) -> None:
    """On the u8 blocks, prefill(N) then decode(t) is prefill(N + t) up to the cache's own rounding, and the
    request reports what its blocks hold: u8 bytes with their scales, nothing copied per step."""
    _, art = intel_artifacts["llama"]
    engine = load(art, kv_precision="u8")
    ids = prompt_ids(PROMPT + 1, seed=6)
    b = engine.prefill(ids[:-1], 2)
    assert b.state.rows is not None
    f32_bytes = engine.session.state_bytes(b.state)
    assert f32_bytes == stateful_bytes(load(art), ids[:-1])
    # per slot and head: a key's and a value's head_dim bytes, each with its own f32 scale and zero point
    # (KEY_CACHE_QUANT_MODE=BY_TOKEN; keys per channel over 32-slot blocks would add 8 * d // 32 instead of 8)
    d = engine.session.head_dim
    per_slot = 2 * (d + 8)
    assert engine.session.cache_bytes(b.state) == PROMPT * engine.session.num_layers * engine.session.kv_heads * per_slot
    assert engine.session.cache_bytes_copied(b.state) == 0
    stepped = engine.decode(b, np.array([ids[-1]]))[0].copy()
    assert b.state.rows is not None and b.state.slots == PROMPT + 1
    engine.session.release(b.state)
    whole = engine.prefill(ids, 1)
    engine.session.release(whole.state)
    within_row(whole.logits, stepped[None], tolerance("intel", "fp32+kv-int8"))
    assert float(np.abs(whole.logits[0] - stepped).max()) < 0.05


def test_paged_prefill_cache_continues(intel_artifacts: dict) -> None:
    """prefill(N) then decode(t) gives the logits prefill(N + t) gives, both through the paged prefill, and the
    request holds N + 1 slots after one engine call and one step."""
    _, art = intel_artifacts["llama"]
    engine = load(art)
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


def test_short_prompts_and_state_batches_keep_the_stateful_call(intel_artifacts: dict) -> None:
    """A prompt under the threshold, one row or a batch, never reaches the paged form, nor does a left-padded batch
    under batch_rows=state (by default a batch is paged as a lone row is)."""
    _, art = intel_artifacts["llama"]
    for engine, prompts in ((load(art, batch_rows="state"), [prompt_ids(PROMPT, 1), prompt_ids(PROMPT - 7, 2)]),
                            (load(art), [prompt_ids(THRESHOLD - 1, 1), prompt_ids(THRESHOLD - 9, 2)]),
                            (load(art), prompt_ids(THRESHOLD - 1, 3))):
        engine.session.prefill_model = None  # type: ignore[assignment]  # calling it would raise
        b = engine.prefill(prompts, 1)
        assert b.state.rows is None
        engine.session.release(b.state)
        assert "long_prefill" not in engine.session.facts


def test_paged_prefill_min_is_a_load_option(intel_artifacts: dict) -> None:
    """Unset, the threshold is the module's default; a length under one token is refused at load."""
    _, art = intel_artifacts["llama"]
    assert kvexport.load(str(art)).session.paged_prefill_min == intel_session.PAGED_PREFILL_MIN
    assert load(art).session.paged_prefill_min == THRESHOLD
    with pytest.raises(InputError, match="paged_prefill_min"):
        kvexport.load(str(art), paged_prefill_min=0)


def test_a_finished_paged_request_leaves_its_block_cache_to_the_next(intel_artifacts: dict) -> None:
    """By default every fresh one-row prompt is paged. A finished request's block cache (its blocks freed) serves the
    next request, which then computes what the first did; a request that starts while another holds the cache gets a
    block cache of its own."""
    _, art = intel_artifacts["llama"]
    engine = kvexport.load(str(art), precision="fp32")
    ids = prompt_ids(PROMPT, seed=7)

    def run() -> tuple[object, list[np.ndarray]]:
        b = engine.prefill(ids, 3)
        out = [b.logits.copy()]
        out.append(engine.decode(b, out[-1].argmax(-1)).copy())
        return b, out

    b1, first = run()
    rows = b1.state.rows
    assert rows is not None and rows.blocks_held() == -(-(PROMPT + 1) // rows.block)
    engine.session.release(b1.state)
    assert rows.blocks_held() == 0 and b1.state.rows is None
    b2, again = run()
    assert b2.state.rows is rows
    for x, y in zip(first, again):
        np.testing.assert_array_equal(x, y)
    b3, other = run()
    assert b3.state.rows is not None and b3.state.rows is not rows
    for x, y in zip(first, other):
        np.testing.assert_array_equal(x, y)
    engine.session.release(b2.state)
    engine.session.release(b3.state)


def batch_and_rows_alone(engine: kvexport.runtime.engine.Engine, rows: list[list[int]],
                         steps: int = 3) -> tuple[kvexport.runtime.engine.Batch, list[np.ndarray], list[list[np.ndarray]]]:
    """The rows as one batch (greedy, `steps` decode steps; its state released) and each row alone under
    Session.batch_row_path, fed the tokens the batch fed it: (the batch, its logits by step, each row's)."""
    together = engine.prefill(rows, steps)
    tog = [together.logits.copy()]
    for _ in range(steps):
        tog.append(engine.decode(together, tog[-1].argmax(-1)).copy())
    engine.session.release(together.state)
    alone = []
    for i, row in enumerate(rows):
        with engine.session.batch_row_path():
            b = engine.prefill(row, steps)
        got = [b.logits[0].copy()]
        for k in range(steps):
            got.append(engine.decode(b, np.array([tog[k][i].argmax()]))[0].copy())
        engine.session.release(b.state)
        alone.append(got)
    return together, tog, alone


def test_a_batch_is_paged_a_row_each_without_its_padding(intel_artifacts: dict) -> None:
    """A batch's prompts are paged as a lone row's are: one block cache of a row each, holding the row's own tokens
    (not the batch's left padding), and every row decodes as it does alone (batch_row_path is a no-op); the cache
    bytes count the rows' own slots."""
    _, art = intel_artifacts["llama"]
    engine = kvexport.load(str(art), precision="fp32")
    rows = [prompt_ids(n, seed=n) for n in (5, 17, 1)]
    together, tog, alone = batch_and_rows_alone(engine, rows)
    assert together.state.rows is None  # released
    b = engine.prefill(rows, 2)
    s = b.state
    assert s.rows is not None and s.rows.rows == 3 and s.pads.tolist() == [12, 0, 16]
    assert s.rows.held.tolist() == [5, 17, 1]
    engine.decode(b, b.logits.argmax(-1))
    assert s.rows.held.tolist() == [6, 18, 2] and s.slots == 18
    per_slot = sum(c.nbytes for c in s.rows.caches) // (s.rows.num_blocks * s.rows.block)
    assert engine.session.cache_bytes(s) == per_slot * 26
    engine.session.release(b.state)
    for i, got in enumerate(alone):
        for a, t in zip(got, tog):
            np.testing.assert_allclose(a, t[i], atol=1e-4 * float(np.abs(t[i]).max()))


def test_a_lone_row_takes_the_batchs_path_under_batch_row_path(intel_artifacts: dict) -> None:
    """With batch_rows=state a batch's prompt runs the fused attention with state and a lone row's is paged by
    default; under Session.batch_row_path (verify's batch-independence check) the lone row takes the state's path,
    and so computes the same logits as its row of the batch, step after step; the default comes back after the
    context."""
    _, art = intel_artifacts["llama"]
    engine = kvexport.load(str(art), precision="fp32", batch_rows="state")
    rows = [prompt_ids(n, seed=n) for n in (5, 17)]
    b = engine.prefill(rows, 1)
    assert b.state.rows is None  # the batch: the state's path
    engine.session.release(b.state)
    _, tog, alone = batch_and_rows_alone(engine, rows, steps=1)
    for i, got in enumerate(alone):
        for a, t in zip(got, tog):
            np.testing.assert_allclose(a, t[i], atol=1e-4 * float(np.abs(t[i]).max()))
    paged = engine.prefill(rows[1], 1)
    assert paged.state.rows is not None  # outside the context a lone row is paged again
    engine.session.release(paged.state)


@pytest.mark.parametrize("kv", ["f32", "u8"])
def test_a_paged_batch_hands_over_to_the_state(intel_artifacts: dict, kv: str) -> None:
    """Steps a paged batch can take (one token a row, then several) stay paged; a step that hides a held slot moves
    the batch to the state, re-run as its prompt was laid out, and it computes what a batch that was never paged
    computes for that step (batch_rows=state), within the cache's rounding."""
    _, art = intel_artifacts["llama"]
    paged, state = (kvexport.load(str(art), precision="fp32", kv_precision=kv, batch_rows=rows)
                    for rows in ("paged", "state"))
    rows = [prompt_ids(n, seed=n + 1) for n in (9, 20)]
    out = []
    for engine in (paged, state):
        b = engine.prefill(rows, 6)
        steps = [b.logits.copy(), engine.decode(b, np.array([7, 8])).copy()]
        s, T = b.state, b.slots
        i = np.arange(3)
        pos = (T - b.pad)[:, None] + i[None, :]
        mask = np.concatenate([np.broadcast_to(b.valid[:, None, :T], (2, 3, T)),
                               np.broadcast_to(np.tri(3, dtype=bool), (2, 3, 3))], axis=2)
        steps.append(engine.session.step(s, np.array([[9, 10, 11], [12, 13, 14]]), pos, mask[:, None])[:].copy())
        assert (s.rows is not None) == (engine is paged)  # a chunk of three tokens a row: still paged
        hidden = np.concatenate([b.valid[:, :T], np.ones((2, 4), bool)], axis=1)  # the three, and the new token
        T += 3
        hidden[1, T - 1] = False  # row 1 no longer sees its last token
        steps.append(engine.session.step(s, np.array([[15], [16]]), (T - b.pad)[:, None], hidden[:, None, None])[:].copy())
        assert s.rows is None and s.slots == T + 1  # the state holds the batch now
        engine.session.release(s)
        out.append(steps)
    atol = 1e-4 if kv == "f32" else 0.5  # u8: paged blocks and the state round alike but not identically
    for got, ref in zip(*out):
        np.testing.assert_allclose(got, ref, atol=atol * float(np.abs(ref).max()))


def test_an_i8_batch_holds_i8_blocks(intel_artifacts: dict) -> None:
    """An i8 engine's batch holds kvexport's int8 blocks (one scale a token and KV head), not OpenVINO's u8 state."""
    from kvexport_intel import int8_blocks

    _, art = intel_artifacts["llama"]
    engine = kvexport.load(str(art), precision="fp32", kv_precision="i8")
    b = engine.prefill([prompt_ids(n, seed=n) for n in (3, 11)], 2)
    s = engine.session
    assert b.state.rows is not None and {c.dtype for c in b.state.rows.caches} == {np.dtype(np.int8)}
    assert s.cache_bytes(b.state) == s.num_layers * int8_blocks.slot_bytes(s.kv_heads, s.head_dim) * 14
    s.release(b.state)


def stateful_bytes(engine: kvexport.runtime.engine.Engine, ids: list[int]) -> int:
    """state_bytes of `ids` prefilled in one stateful call."""
    with stateful(engine, len(ids)):
        b = engine.prefill(ids, 1)
    n = engine.session.state_bytes(b.state)
    engine.session.release(b.state)
    return n


def test_paged_request_takes_a_later_chunk(intel_artifacts: dict) -> None:
    """A chunk of several tokens after a paged prefill goes to the same blocks: its last logits are the whole
    prompt's."""
    _, art = intel_artifacts["llama"]
    engine = load(art)
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


@pytest.mark.parametrize("kv", ["f32", "u8", "i8"])
def test_a_step_paged_attention_cannot_take_hands_over(intel_artifacts: dict, kv: str) -> None:
    """A step that hides a held slot is not paged attention's: the request moves to the state first, and the logits
    are those of the same step after one stateful prefill. f32 blocks are copied into the state; u8 blocks, whose
    layout the plugin does not document, are not read back: the request's tokens (the prompt and a paged decode
    step) are re-run into the state, which then holds what a request that never went paged holds; i8 blocks (kvexport's
    own, whose engine keeps a u8 state) likewise, rather than rounding them a second time."""
    _, art = intel_artifacts["llama"]
    engine = load(art, kv_precision=kv)
    ids = prompt_ids(PROMPT + 2, seed=8)
    mask = np.ones((1, 1, 1, PROMPT + 2), bool)
    mask[..., 3] = False  # the fourth prompt token hidden from the new one

    def hidden_step(long: bool) -> np.ndarray:
        with stateful(engine, PROMPT) if not long else nullcontext():
            b = engine.prefill(ids[:PROMPT], 3)
        assert (b.state.rows is not None) == long
        engine.decode(b, np.array([ids[PROMPT]]))
        assert (b.state.rows is not None) == long and b.state.slots == PROMPT + 1
        out = engine.session.step(b.state, np.array([[ids[PROMPT + 1]]]), np.array([[PROMPT + 1]]), mask)[0].copy()
        assert b.state.rows is None and b.state.slots == PROMPT + 2
        assert engine.session.cache_bytes_copied(b.state) is None  # the state holds it now
        engine.session.release(b.state)
        return out

    stateful_logits, handed = hidden_step(False), hidden_step(True)
    gap = float(np.abs(stateful_logits - handed).max())
    assert gap <= tolerance("intel", "fp32").max_abs_logit, gap
    with stateful(engine, PROMPT + 2):
        seen = engine.prefill(ids, 1).logits[0]  # the same token seeing slot 3: the mask did change the logits
    assert float(np.abs(seen - handed).max()) > 10 * max(gap, 1e-6)
    assert int(stateful_logits.argmax()) == int(handed.argmax())


def test_paged_form_splits_the_packed_projections(intel_artifacts: dict) -> None:
    """The paged form runs the IR's packed q|k|v projection (qkv), or that and gate|up (all), as one MatMul per piece
    (no VariadicSplit copy of every token's projection), each piece's weight a view of the packed one's memory, with
    the packed form's logits."""
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

    def weights(model: ov.Model) -> list[tuple[int, int]]:  # each matmul weight's memory: (address, bytes)
        found = []
        for op in model.get_ordered_ops():
            if op.get_type_name() == "MatMul" and op.input_value(1).get_node().get_type_name() == "Constant":
                data = op.input_value(1).get_node().get_data()
                found.append((data.ctypes.data, data.nbytes))
        return found

    logits, counts = [], []
    for split in ("none", "qkv", "all"):
        model = core.read_model(engine.session.model_path)
        packed = weights(model)
        assert to_paged(model, engine.session.windows, split) is None
        assert split_matmuls(model) == {"none": 2, "qkv": 1, "all": 0}[split] * layers
        counts.append(matmuls(model))
        # the pieces lie inside the packed weights' memory: the cut copies nothing
        for address, size in weights(model):
            assert any(start <= address and address + size <= start + n for start, n in packed), (address, size)
        rows = PagedRows(core.compile_model(model, "CPU", engine.session.compile_config), rows=1, max_seq=PROMPT,
                         num_layers=layers, vocab_size=engine.vocab_size)
        logits.append(rows.extend(0, np.array(prompt_ids(PROMPT, seed=9))).copy())
    # q|k|v into three (two more a layer), gate|up into two (one more); no packed MatMul left running
    assert counts[1] == counts[0] + 2 * layers and counts[2] == counts[0] + 3 * layers
    for cut in logits[1:]:
        gap = float(np.abs(logits[0] - cut).max())
        assert gap <= tolerance("intel", "fp32").max_abs_logit, gap


def test_the_load_option_paged_split_chooses_the_paged_forms_projections(intel_artifacts: dict) -> None:
    """Packed by default (each request decodes paged, where the pieces did not pay: docs/backends/intel.md); qkv and
    all are compiled as asked, with the packed form's greedy tokens; a value that is not one of them is refused at
    load."""
    from kvexport_intel import lowering

    _, art = intel_artifacts["llama"]
    splits, tokens = {}, []
    for value in (None, "qkv", "all"):
        engine = kvexport.load(str(art), precision="fp32", **({"paged_split": value} if value else {}))
        compiled, why = engine.session.paged_model()
        assert why is None
        chosen = engine.session.describe()["paged_split"]
        assert chosen == (value or "none")
        splits[chosen] = lowering.runtime_op_counts(compiled)["Split"]
        tokens.append(engine.generate(prompt_ids(PROMPT, seed=12), max_new_tokens=8).token_ids)
    layers = engine.session.num_layers
    assert splits["none"] >= 2 * layers
    assert splits["qkv"] == splits["none"] - layers and splits["all"] == splits["none"] - 2 * layers
    assert tokens[0] == tokens[1] == tokens[2]
    with pytest.raises(InputError, match="paged_split"):
        kvexport.load(str(art), paged_split="sometimes")


def test_the_load_option_prompt_split_runs_prompts_through_a_second_form(intel_artifacts: dict) -> None:
    """prompt_split=all compiles a second paged form, every projection cut, that runs the steps of prompts over the
    same blocks while decode steps keep the packed form (the load warms both, whatever paged_prefill_min is): the
    prompt's logits come out of the prompt form's request, the decode step's out of the decode form's, both within
    the fp32 row of the default engine's, the same greedy tokens. The default (same) compiles no second form;
    another value is refused."""
    _, art = intel_artifacts["llama"]
    ids = prompt_ids(PROMPT, seed=14)
    plain = kvexport.load(str(art), precision="fp32", paged_prefill_min=THRESHOLD)
    assert plain.session.describe()["prompt_split"] == "none" and plain.session.prompt_form() is None
    cut = kvexport.load(str(art), precision="fp32", prompt_split="all", paged_prefill_min=THRESHOLD)
    assert cut.session.describe()["prompt_split"] == "all"
    assert "second paged form" in cut.session.describe()["prompt_form"]
    warmed = cut.session._row_pool[-1].prompt_request.get_output_tensor(0)  # the load ran both forms once
    assert int(np.prod(warmed.shape)) == cut.vocab_size
    row = tolerance("intel", "fp32").max_abs_logit
    batches = [engine.prefill(ids, STEPS) for engine in (plain, cut)]
    rows = batches[1].state.rows
    assert rows.prompt_request is not None and batches[0].state.rows.prompt_request is None
    prompt_out = rows.prompt_request.get_output_tensor(0).data.reshape(-1, cut.vocab_size)[-1]
    assert np.array_equal(prompt_out, batches[1].logits[0])  # the prompt ran the prompt form
    assert float(np.abs(batches[0].logits - batches[1].logits).max()) <= row
    token = int(batches[0].logits[0].argmax())
    steps = [engine.decode(batch, np.array([token])) for engine, batch in zip((plain, cut), batches)]
    decode_out = rows.request.get_output_tensor(0).data.reshape(-1, cut.vocab_size)[-1]
    assert np.array_equal(decode_out, steps[1][0])  # the decode step ran the packed form
    assert float(np.abs(steps[0] - steps[1]).max()) <= row
    for engine, batch in zip((plain, cut), batches):
        engine.session.release(batch.state)
    tokens = [engine.generate(ids, max_new_tokens=STEPS).token_ids for engine in (plain, cut)]
    assert tokens[0] == tokens[1]
    with pytest.raises(InputError, match="prompt_split"):
        kvexport.load(str(art), prompt_split="cut")


def test_a_prompt_mask_with_constant_diagonals_is_judged_by_its_first_row_and_column() -> None:
    """_causal reads only row 0 and column 0 of a view whose element (i, j) lies at (j - i) strides (Engine.prefill's
    unpadded mask): each such view that is not the triangle is refused, and every dense mask is read in full."""
    from numpy.lib.stride_tricks import as_strided
    from kvexport.runtime.engine import causal

    S = 6
    for cut in range(1, 2 * S):  # base[:cut] True: the triangle at cut == S only
        base = np.arange(2 * S - 1) < cut
        view = as_strided(base[S - 1:], shape=(S, S), strides=(-1, 1), writeable=False)
        assert intel_session._causal(view) == (cut == S) == np.array_equal(view, np.tri(S, dtype=bool))
    hole = np.arange(2 * S - 1) < S
    hole[2] = False  # a hidden key on the diagonal i - j = 3: every diagonal meets row 0 or column 0
    view = as_strided(hole[S - 1:], shape=(S, S), strides=(-1, 1))
    assert not intel_session._causal(view)
    assert intel_session._causal(causal(1, 4096)[0]) and intel_session._causal(np.tri(300, dtype=bool))
    dense = np.tri(300, dtype=bool)
    dense[299, 3] = False  # off every diagonal the first row and column show
    assert not intel_session._causal(dense)
