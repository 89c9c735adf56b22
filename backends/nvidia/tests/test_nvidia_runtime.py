"""The TensorRT session's host-side logic, with stand-ins for the engine and context objects.

No TensorRT here: these check what kvexport computes and hands TensorRT (input padding, write
index, aliased cache addresses, the checks before a step), not TensorRT itself (test_nvidia_gpu).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from kvexport.errors import ContextOverflowError, InputError
from kvexport.runtime.ring import MASK_INPUT, RingSpec
from kvexport_nvidia.runtime import TrtSession, _State, graph_step, step_feeds, swap_rings
from kvexport_nvidia.trt_build import EngineBuildError

PAIRS = [("past_key_values.0.key", "present.0.key"), ("past_key_values.0.value", "present.0.value")]


class FakeEngine:
    def __init__(self, alias: dict[str, str]):
        self.alias = alias
        self.names = ["input_ids", "position_ids", "write_index", "attention_mask", "logits",
                      *[n for p in PAIRS for n in p]]
        self.num_io_tensors = len(self.names)

    def get_tensor_name(self, i: int) -> str:
        return self.names[i]

    def get_aliased_input_tensor(self, name: str) -> str | None:
        return self.alias.get(name)


@dataclass
class FakeTensor:
    shape: tuple[int, ...]
    ptr: int

    def data_ptr(self) -> int:
        return self.ptr


@dataclass
class FakeContext:
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    addresses: dict[str, int] = field(default_factory=dict)

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        self.shapes[name] = shape
        return True

    def set_tensor_address(self, name: str, ptr: int) -> bool:
        self.addresses[name] = ptr
        return True


def _session(alias: dict[str, str] | None = None, max_seq: int = 16) -> TrtSession:
    s = object.__new__(TrtSession)  # skips __init__'s TensorRT import and device setup
    s._engine = FakeEngine(alias if alias is not None else {present: past for past, present in PAIRS})
    s._io = set(s._engine.names)
    s.pairs, s.max_seq, s.vocab_size = PAIRS, max_seq, 10
    s.ring, s.limit = None, max_seq
    return s


def _state(held: int = 0, batch: int = 2) -> _State:
    caches = [FakeTensor((batch, 2, 16, 4), 0x1000 * (i + 1)) for i in range(len(PAIRS))]
    return _State(batch=batch, capacity=16, caches=caches, stream=None, contexts=[], held=held)


def test_aliasing_is_checked_per_pair() -> None:
    _session()._check_aliasing()
    with pytest.raises(EngineBuildError, match="not aliased"):
        _session({"present.0.key": "past_key_values.0.key"})._check_aliasing()
    with pytest.raises(EngineBuildError, match="not aliased"):
        _session({"present.0.key": "past_key_values.0.value", "present.0.value": "past_key_values.0.key"})._check_aliasing()


def test_bind_gives_present_the_address_of_past() -> None:
    s, st, ctx = _session(), _state(), FakeContext()
    inputs = {"input_ids": FakeTensor((2, 3), 0x10), "attention_mask": FakeTensor((2, 1, 3, 16), 0x20)}
    s._bind(st, ctx, inputs, FakeTensor((2, 1, 10), 0x30))
    for (past, present), cache in zip(PAIRS, st.caches):
        assert ctx.addresses[past] == ctx.addresses[present] == cache.ptr
        assert ctx.shapes[past] == cache.shape
    assert ctx.addresses["logits"] == 0x30 and ctx.shapes["attention_mask"] == (2, 1, 3, 16)
    assert "logits" not in ctx.shapes and not any(p in ctx.shapes for _, p in PAIRS)  # outputs get no shapes


def test_host_inputs_pad_the_mask_to_max_seq_and_write_at_held() -> None:
    s, st = _session(), _state(held=5)
    ids = np.array([[7], [8]], np.int64)
    mask = np.ones((2, 1, 1, 6), bool)
    mask[1, ..., :2] = False  # row 1 is left-padded by 2
    host = s._host_inputs(st, ids, np.array([[5], [3]], np.int64), mask)
    assert host["write_index"].tolist() == [5, 5]  # every row appends at slot T
    full = host["attention_mask"]
    assert full.shape == (2, 1, 1, 16) and full.dtype == np.bool_
    assert (full[..., :6] == mask).all() and not full[..., 6:].any()  # unused slots never visible


def test_step_checks_before_touching_the_gpu() -> None:
    s, st = _session(max_seq=16), _state(held=4)
    ids, pos = np.ones((2, 1), np.int64), np.ones((2, 1), np.int64)
    ok = np.ones((2, 1, 1, 5), bool)
    assert s._validate(st, ids, pos, ok) == (2, 1)
    with pytest.raises(InputError, match="int64"):
        s._validate(st, ids.astype(np.int32), pos, ok)
    with pytest.raises(InputError, match=r"\(B, 1, S, T\+S\)"):
        s._validate(st, ids, pos, np.ones((2, 1, 1, 4), bool))
    with pytest.raises(InputError, match="holds 2 rows"):
        s._validate(st, ids[:1], pos[:1], ok[:1])
    full = _state(held=16)
    with pytest.raises(ContextOverflowError, match="max_seq=16"):
        s._validate(full, ids, pos, np.ones((2, 1, 1, 17), bool))


def test_new_state_refuses_more_than_max_seq() -> None:
    with pytest.raises(ContextOverflowError, match="max_seq 16"):
        _session(max_seq=16).new_state(1, 17)


class FakeGraph:
    def __init__(self, log: list[str]):
        self.log = log

    def replay(self) -> None:
        self.log.append("replay")


def test_graph_step_captures_once_then_replays_and_counts_both() -> None:
    st, log = _state(), []
    for _ in range(5):
        graph_step(st, eager=lambda: log.append("eager"), capture=lambda: log.append("capture") or FakeGraph(log))
    assert log == ["eager", "capture", "replay", "replay", "replay", "replay"]  # the first step's result is eager
    assert (st.captures, st.replays) == (1, 4)


def test_a_failed_eager_step_captures_nothing() -> None:
    st = _state()

    def fail() -> None:
        raise EngineBuildError("execute_async_v3 failed")

    with pytest.raises(EngineBuildError):
        graph_step(st, eager=fail, capture=lambda: pytest.fail("captured after a failed step"))
    assert st.graph is None and (st.captures, st.replays) == (0, 0)


def test_ring_present_goes_to_the_second_buffer_and_swaps_with_its_decode_graph() -> None:
    """A ring's present is IScatterLayer's own output: bound to the ring's second buffer, never aliased; after
    the step the two swap, and so do the decode graphs captured with each order of the buffers."""
    s = _session({})  # no present aliased: refused for full-length layers, right for a ring layer's
    with pytest.raises(EngineBuildError, match="not aliased"):
        s._check_aliasing()
    s.ring, s.limit = RingSpec(window=4, layers=frozenset({0}), num_layers=1, max_positions=64), 64
    s._check_aliasing()
    st = _state()
    ring0, ring1 = FakeTensor((2, 2, 4, 4), 0xA000), FakeTensor((2, 2, 4, 4), 0xB000)
    st.caches, st.spares = [ring0, ring1], [FakeTensor((2, 2, 4, 4), 0xA100), FakeTensor((2, 2, 4, 4), 0xB100)]
    ctx = FakeContext()
    s._bind(st, ctx, {}, FakeTensor((2, 1, 10), 0x30))
    assert ctx.addresses["past_key_values.0.key"] == 0xA000 and ctx.addresses["present.0.key"] == 0xA100
    st.graph, st.other_graph = "graph-even", None
    swap_rings(st)
    assert [c.ptr for c in st.caches] == [0xA100, 0xB100] and [c.ptr for c in st.spares] == [0xA000, 0xB000]
    assert (st.graph, st.other_graph, st.swaps) == (None, "graph-even", 1)  # the odd order gets its own capture
    swap_rings(st)
    assert st.graph == "graph-even" and st.caches[0].ptr == 0xA000


def test_step_feeds_give_rings_their_mask_and_drop_the_full_one_where_every_layer_slides() -> None:
    ring = RingSpec(window=4, layers=frozenset({0}), num_layers=1, max_positions=64)
    held = np.ones((1, 1, 1, 11), bool)  # 10 held + 1 new, past the 4-slot ring
    f = step_feeds(10, np.ones((1, 1), np.int64), np.full((1, 1), 10), held, max_seq=16, ring=ring, full_mask=False)
    assert "attention_mask" not in f and f["write_index"].tolist() == [10]
    # ring slots hold tokens 8, 9, 6, 7: the query at 10 sees 8 and 9 (10 - 7 = 3 < 4 too), then itself
    assert f[MASK_INPUT].tolist() == [[[[True, True, False, True, True]]]]
    f = step_feeds(10, np.ones((1, 1), np.int64), np.full((1, 1), 10), held, max_seq=16, ring=ring, full_mask=True)
    assert f["attention_mask"].shape == (1, 1, 1, 16) and f["attention_mask"][..., 11:].sum() == 0
