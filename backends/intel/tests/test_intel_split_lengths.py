"""The decoder's gate|up chunk traces to a VariadicSplit whose lengths are shape arithmetic; the CPU plugin runs such a
split with its output shapes read from data (a sync point of the dynamic graph each step). Builds and loads give it
constant lengths where its pieces' sizes are static: the same outputs, the plugin's own Split."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("openvino", reason="the intel target needs openvino (pip install 'kvexport[intel]')")

import openvino as ov  # noqa: E402
import openvino.opset13 as ops  # noqa: E402

from kvexport_intel import lowering  # noqa: E402


def _chunked(width: int) -> ov.Model:
    """x (?, 1, width) split in two halves whose lengths come from x's shape, as torch.chunk traces."""
    x = ops.parameter(ov.PartialShape([-1, 1, width]), ov.Type.f32, name="x")
    last = ops.gather(ops.shape_of(x), ops.constant(np.array([2], np.int64)), ops.constant(np.int64(0)))
    half = ops.divide(last, ops.constant(np.array([2], np.int64)))
    split = ops.variadic_split(x, ops.constant(np.int64(-1)), ops.concat([half, half], 0))
    return ov.Model([ops.relu(split.output(0)), ops.multiply(split.output(1), split.output(1))], [x])


def _lengths_kinds(model: ov.Model) -> list[str]:
    return [op.input_value(2).get_node().get_type_name() for op in model.get_ordered_ops()
            if op.get_type_name() == "VariadicSplit"]


def test_computed_split_lengths_become_constants_with_the_same_outputs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    x = np.random.default_rng(0).standard_normal((5, 1, 8)).astype(np.float32)
    core = ov.Core()
    before = [np.asarray(o) for o in core.compile_model(_chunked(8), "CPU")({"x": x}).values()]
    model = _chunked(8)
    assert _lengths_kinds(model) == ["Concat"]
    assert lowering.static_split_lengths(model) == 1
    assert _lengths_kinds(model) == ["Constant"]
    split = next(op for op in model.get_ordered_ops() if op.get_type_name() == "VariadicSplit")
    assert list(split.input_value(2).get_node().get_data()) == [4, 4]
    after = [np.asarray(o) for o in core.compile_model(model, "CPU")({"x": x}).values()]
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    assert lowering.static_split_lengths(model) == 0  # nothing left to fix
    # an engine saved before builds did this gets it when it is read for compiling
    ov.save_model(_chunked(8), str(tmp_path / "old.xml"))
    assert _lengths_kinds(lowering.read_engine(core, tmp_path / "old.xml")) == ["Constant"]


def test_a_split_with_pieces_of_unknown_size_is_left_as_it_is() -> None:
    x = ops.parameter(ov.PartialShape([-1, 1, -1]), ov.Type.f32, name="x")  # the split axis itself dynamic
    last = ops.gather(ops.shape_of(x), ops.constant(np.array([2], np.int64)), ops.constant(np.int64(0)))
    half = ops.divide(last, ops.constant(np.array([2], np.int64)))
    split = ops.variadic_split(x, ops.constant(np.int64(-1)), ops.concat([half, half], 0))
    model = ov.Model([split.output(0), split.output(1)], [x])
    assert lowering.static_split_lengths(model) == 0
    assert _lengths_kinds(model) == ["Concat"]


def test_a_built_engine_splits_its_packed_projections_by_constant_lengths(intel_artifacts: dict) -> None:
    _, art = intel_artifacts["llama"]
    kinds = _lengths_kinds(ov.Core().read_model(str(art / "engine" / lowering.XML)))
    assert kinds and set(kinds) == {"Constant"}, kinds  # q|k|v and gate|up, every layer
