"""Sliding-window layers on ring caches: the tiny mistral (window 24, every layer slides) keeps 24 slots per
layer on the cpu target, generates past max_seq token-identical to transformers, and its rings are written
in place (kvexport/runtime/ring.py, Decoder.ring_layers, TensorScatter mode=circular)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import pytest

import kvexport
from kvexport import backends
from kvexport import manifest as mf
from kvexport.errors import ContextOverflowError
from kvexport.runtime.ring import MASK_INPUT, RING_DIM, RING_MASK_DIM, RingSpec, ring_slots, sliding_mask
from kvexport.runtime.rows import BoundRows
from kvexport.tolerances import tolerance
from kvexport.zoo import TINY_CONFIGS
from tests.conftest import MAX_SEQ, HFReference, random_ids

TOL = tolerance("cpu", "fp32")
W = TINY_CONFIGS["mistral"]["sliding_window"]  # 24
POSITIONS = TINY_CONFIGS["mistral"]["max_position_embeddings"]  # 256


@pytest.fixture(scope="module")
def mistral(artifacts: dict[str, Path]) -> kvexport.runtime.engine.Engine:
    return kvexport.load(artifacts["mistral"], threads=2)


def ring_bytes(engine: kvexport.runtime.engine.Engine, batch: int) -> int:
    """Every layer's K and V at W slots: what the cache is when every layer is a ring."""
    cfg = engine.config
    return 2 * cfg.num_hidden_layers * batch * cfg.num_key_value_heads * W * cfg.head_dim * 4


def test_ring_slots_and_mask_say_which_token_each_slot_holds() -> None:
    # 6 slots held, a 4-slot ring: slots 4, 5, 2, 3 (written 0..5 modulo 4); nothing written yet is -1..-4
    assert ring_slots(np.array([6, 0]), 4).tolist() == [[4, 5, 2, 3], [-4, -3, -2, -1]]
    held = np.ones((1, 1, 2, 8), dtype=bool)  # 6 held + 2 new, no padding
    held[0, 0, 0, 7] = False  # causal
    m = sliding_mask(held, 4, 3)[0, 0]  # window 3: a query sees itself and the 2 slots before it
    # ring holds 4, 5, 2, 3: query 6 sees 4 and 5; query 7 sees 5 only (7 - 4 = 3 is outside the window)
    assert m.tolist() == [[True, True, False, False, True, False], [False, True, False, False, True, True]]


def test_manifest_and_graph_keep_every_layer_on_a_window_sized_ring(artifacts: dict[str, Path]) -> None:
    folder = artifacts["mistral"]
    m = mf.read(folder)
    spec = RingSpec.of(m)
    assert spec is not None and spec.window == W and spec.layers == {0, 1} and spec.every_layer
    assert m.cache["max_positions"] == POSITIONS > m.max_seq
    assert [x["slots"] for x in m.cache["layers"]] == [RING_DIM, RING_DIM]
    shapes = {io["name"]: io["shape"] for io in [*m.inputs, *m.outputs]}
    assert "attention_mask" not in shapes  # no layer keeps a full-length cache
    assert shapes[MASK_INPUT] == ["batch", 1, "seq", RING_MASK_DIM]
    assert shapes["past_key_values.1.value"][2] == shapes["present.0.key"][2] == RING_DIM
    g = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in [*g.input, *g.output]}
    assert {n: d for n, d in dims.items() if n in shapes} == shapes  # the manifest says what the graph holds
    producers = {o: n for n in g.node for o in n.output}
    scatters = [n for n in g.node if n.op_type == "TensorScatter"]
    assert len(scatters) == 4
    for n in scatters:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert attrs["mode"] == b"circular" and n.input[0].startswith("past_key_values.")
        # the written rows come out of the Concat the attention reads: the write cannot run before that read
        assert producers[producers[n.input[1]].input[0]].op_type == "Concat"
    for a in (n for n in g.node if n.op_type == "Attention"):
        assert producers[a.input[1]].op_type == "Concat" and a.input[3] == MASK_INPUT
    engine_graph = onnx.load(str(folder / "engine" / "model.opt.onnx"), load_external_data=False).graph
    ops = [n.op_type for n in engine_graph.node]
    assert "GroupQueryAttention" not in ops and ops.count("Attention") == 2  # ring layers stay unfused


def test_generates_past_max_seq_token_identical_with_cache_bytes_bounded_by_the_window(
        mistral: kvexport.runtime.engine.Engine, references: dict[str, HFReference]) -> None:
    """4x the window and past max_seq (40 + 150 = 190 slots > 128): transformers' tokens at every step, while
    the cache stays one W-slot ring per layer, written in place (no byte copied, no buffer moved)."""
    e = mistral
    prompt = random_ids(40, seed=4)  # longer than the window: prefilled in ring-sized pieces
    n = 150
    assert n >= 4 * W and len(prompt) + n > MAX_SEQ
    b = e.prefill(prompt, n)
    st = b.state
    assert e.session.cache_bytes(st) == ring_bytes(e, 1)
    ptrs = [c.ctypes.data for c in st.caches]
    logits, toks = [b.logits[0].copy()], [int(b.logits[0].argmax())]
    for _ in range(n - 1):
        logits.append(e.decode(b, np.array([toks[-1]]))[0].copy())
        toks.append(int(logits[-1].argmax()))
    assert b.slots == len(prompt) + n - 1 > MAX_SEQ
    assert e.session.cache_bytes(st) == ring_bytes(e, 1) and st.bytes_copied == 0
    assert [c.ctypes.data for c in st.caches] == ptrs
    e.session.release(st)
    ref = references["mistral"].logits(prompt + toks[:-1])[len(prompt) - 1:]
    assert toks == ref.argmax(-1).tolist()
    assert np.abs(np.stack(logits) - ref).max() < TOL.max_abs_logit


def test_generate_past_max_seq_and_overflow_past_the_model_positions(mistral: kvexport.runtime.engine.Engine) -> None:
    e = mistral
    assert e.limit == POSITIONS
    assert len(e.generate(random_ids(10, seed=1), 140, stop=()).token_ids) == 140  # 150 > max_seq 128
    calls = []
    orig = e.session.step
    e.session.step = lambda *a, **k: calls.append(1) or orig(*a, **k)  # type: ignore[method-assign]
    try:
        with pytest.raises(ContextOverflowError, match="max_position_embeddings"):
            e.generate(random_ids(100), POSITIONS - 99)
    finally:
        e.session.step = orig  # type: ignore[method-assign]
    assert calls == []


def test_prefill_then_decode_equals_prefill_across_the_ring(mistral: kvexport.runtime.engine.Engine) -> None:
    """prefill(N) + decode(1) == prefill(N + 1), N around the window and its multiples (chunk edges)."""
    e = mistral
    ids = random_ids(80, seed=11)
    for n in (W - 1, W, W + 1, 2 * W - 1, 2 * W, 2 * W + 1, 70):
        b = e.prefill(ids[:n], 1)
        stepped = e.decode(b, np.array([ids[n]]))[0].copy()
        e.session.release(b.state)
        whole = e.prefill(ids[: n + 1], 0)
        assert np.abs(stepped - whole.logits[0]).max() < 1e-5, n
        e.session.release(whole.state)


def test_left_padded_batch_equals_its_rows_alone_on_the_ring(mistral: kvexport.runtime.engine.Engine) -> None:
    e = mistral
    prompts = [random_ids(n, seed=n) for n in (5, 30, 57)]  # padding longer than the window in the first row
    together = e.generate(prompts, 40, stop=())
    alone = [e.generate(p, 40, stop=()) for p in prompts]
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]


def test_a_decode_step_changes_only_its_own_ring_slot(mistral: kvexport.runtime.engine.Engine) -> None:
    e = mistral
    b = e.prefill(random_ids(30, seed=2), 40)
    tok = b.logits.argmax(-1)
    for _ in range(30):
        T = b.slots
        before = [c.copy() for c in b.state.caches]
        tok = e.decode(b, tok).argmax(-1)
        for old, new in zip(before, b.state.caches):
            changed = np.flatnonzero((old != new).any(axis=(0, 1, 3)))
            assert changed.tolist() == [T % W]  # slot T's ring slot; the other W - 1 keep their bits
    e.session.release(b.state)


def test_bound_rows_keep_rings_and_match_each_row_alone(mistral: kvexport.runtime.engine.Engine) -> None:
    """The scheduler's rows on ring caches: rows of different lengths decoded together past the window,
    a prompt longer than the window extended in one call; each row equals its prompt alone."""
    e = mistral
    prompts = [random_ids(n, seed=n + 1) for n in (7, 50)]
    alone = [e.generate(p, 30, stop=()).token_ids for p in prompts]
    rows = BoundRows(e.session, 3)
    assert rows.cache_bytes() == ring_bytes(e, 3)
    got: list[list[int]] = [[], []]
    for r, p in enumerate(prompts):
        rows.reset(r, len(p) + 30)
        got[r].append(int(rows.extend(r, np.array(p)).argmax()))
    for _ in range(29):
        lg = rows.decode(np.array([0, 1]), np.array([got[0][-1], got[1][-1]]))
        for r in range(2):
            got[r].append(int(lg[r].argmax()))
    assert got == alone
    assert rows.cache_bytes() == ring_bytes(e, 3) and rows.bytes_copied == 0
    rows.release()


def test_a_target_without_rings_refuses_a_ring_ir(artifacts: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A target whose capabilities keep full-length caches refuses an IR with rings before any work. nvidia keeps
    rings (backends/nvidia/tests/test_nvidia_ring.py), so the rule is checked on it made to say it does not."""
    backend = backends.get("nvidia")
    m = mf.read(artifacts["mistral"])
    assert backend.capabilities().ring_cache and backend.check(m) == []
    caps = dataclasses.replace(backend.capabilities(), ring_cache=False)
    monkeypatch.setattr(type(backend), "capabilities", lambda self: caps)
    problems = backend.check(m)
    assert any("ring" in p for p in problems), problems


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_mixed_model_keeps_only_its_sliding_layers_on_rings(family: str, artifacts: dict[str, Path],
                                                             references: dict[str, HFReference]) -> None:
    """gemma2 (sliding, global alternating) and gemma3 (5 sliding : 1 global): the global layers grow with the
    request, the sliding ones stop at their window; 4x the window token-identical to transformers."""
    if family not in TINY_CONFIGS:
        pytest.skip(f"{family} is not a registered family in this tree")
    e = kvexport.load(artifacts[family], threads=2)
    cfg = e.config
    spec = RingSpec.of(e.manifest)
    window = cfg.sliding_window
    sliding = [i for i in range(cfg.num_hidden_layers) if cfg.window_of(i) is not None]
    assert spec is not None and sorted(spec.layers) == sliding and not spec.every_layer and e.limit == MAX_SEQ
    prompt = random_ids(20, seed=8)
    n = 4 * window + 8
    b = e.prefill(prompt, n)
    toks = [int(b.logits[0].argmax())]
    for _ in range(n - 1):
        toks.append(int(e.decode(b, np.array([toks[-1]]))[0].argmax()))
    per_slot = 2 * cfg.num_key_value_heads * cfg.head_dim * 4  # K and V of one layer, one row, fp32
    capacity = b.state.capacity
    assert capacity >= len(prompt) + n - 1 > window
    full = cfg.num_hidden_layers * capacity * per_slot
    rings = (cfg.num_hidden_layers - len(sliding)) * capacity * per_slot + len(sliding) * window * per_slot
    assert e.session.cache_bytes(b.state) == rings < full
    print(f"\n{family}: cache {rings} bytes with {len(sliding)} of {cfg.num_hidden_layers} layers on {window}-slot "
          f"rings, {full} were every layer full length ({capacity} slots)")
    e.session.release(b.state)
    ref = references[family].logits(prompt + toks[:-1])[len(prompt) - 1:]
    assert toks == ref.argmax(-1).tolist()


def test_inspect_prints_the_rings_beside_an_all_global_cache(artifacts: dict[str, Path],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from kvexport.cli import main

    assert main(["inspect", str(artifacts["mistral"])]) == 0
    out = capsys.readouterr().out
    # 2 layers x K,V x 2 kv heads x 16 head_dim x 4 bytes = 512 bytes a slot: 24 slots on rings, 128 full length
    assert f"2 of 2 keep {W} slots; {512 * W} bytes (0.01 MiB) per row at max_seq beside {512 * MAX_SEQ} bytes" in out, out
    assert f"positions up to {POSITIONS} (past max_seq)" in out


def test_int8_cache_is_refused_for_rings_before_any_work(artifacts: dict[str, Path]) -> None:
    """The cpu int8 cache is GroupQueryAttention's, which has no ring: refused with what to do, nothing written."""
    from kvexport.backends import BuildOptions
    from kvexport.errors import InputError

    folder = artifacts["mistral"]
    before = sorted(p.name for p in folder.rglob("*"))
    with pytest.raises(InputError, match="--kv fp32"):
        backends.get("cpu").build(folder, mf.read(folder), BuildOptions(kv="int8"), lambda _m: None)
    assert sorted(p.name for p in folder.rglob("*")) == before


@pytest.mark.parametrize(("options", "why"), [({"kv": "int8"}, "no ring"),
                                               ({"extra": {"ring_cache": "false"}}, "ring_cache=false")])
def test_builds_that_keep_sliding_layers_full_length(options: dict, why: str, tmp_path: Path,
                                                     checkpoints: dict[str, Path]) -> None:
    """`kvexport build --kv int8` on a sliding model (GroupQueryAttention's int8 cache has no ring) and
    `--option ring_cache=false`: the build exports the IR without rings, says why, and every layer is fused."""
    import onnx

    from kvexport.backends import BuildOptions
    from kvexport.build import build

    said: list[str] = []
    out = build(checkpoints["mistral"], tmp_path / "m.kvx", max_seq=MAX_SEQ, options=BuildOptions(**options),
                verify=False, progress=said.append)
    m = mf.read(out)
    assert RingSpec.of(m) is None and all(x["slots"] != RING_DIM for x in m.cache["layers"])
    assert m.raw["target"]["kv"]["dtype"] == options.get("kv", "fp32")
    assert any("full-length caches" in s and why in s for s in said), said
    graph = onnx.load(str(out / "engine" / "model.opt.onnx"), load_external_data=False).graph
    # an int8 cache keeps each layer's kernel in the one-token branch of an If (cpu_kv.branch_attention)
    ops = [n.op_type for n in graph.node] + [k.op_type for n in graph.node if n.op_type == "If"
                                              for a in n.attribute if a.name == "else_branch" for k in a.g.node]
    assert ops.count("GroupQueryAttention") == m.config.num_hidden_layers
    e = kvexport.load(out, threads=2)
    b = e.prefill(random_ids(12, seed=3), 4)
    assert b.logits.shape[-1] == e.config.vocab_size and np.isfinite(b.logits).all()
    e.session.release(b.state)
