"""nvidia int8/int4 weights: the DequantizeLinear the packaged graph holds, its numerics on ONNX Runtime, the
records, the errors, and the trained default model through the graph TensorRT would parse against its rows."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kvexport.artifact import open_artifact
from kvexport.backends import BuildOptions
from kvexport.errors import InputError
from kvexport.testing import default_checkpoint_once, exports_made_once
from kvexport_nvidia import quantize as q
from kvexport_nvidia.backend import ENGINE_DIR, PREPARED
from kvexport_nvidia.lowering import lower

from nvidia_ort_twin import OrtTwinSession, twin_options


def _matmul_model(shapes: dict[str, tuple[int, int]]) -> onnx.ModelProto:
    """x (1, K) through one MatMul per named weight (K, N), each output a graph output."""
    rng = np.random.default_rng(0)
    nodes, inits, outs = [], [], []
    K = next(iter(shapes.values()))[0]
    for name, (k, n) in shapes.items():
        assert k == K
        w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"{name}/weight_t"))
        nodes.append(helper.make_node("MatMul", ["x", f"{name}/weight_t"], [f"{name}_y"], name=f"{name}/MatMul_0"))
        outs.append(helper.make_tensor_value_info(f"{name}_y", TensorProto.FLOAT, [1, n]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, K])], outs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)])
    model.ir_version = 11
    return model


def _run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), twin_options(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})


def test_int4_weights_are_blocked_dequantize_of_packed_int4_and_run_as_numpy_says() -> None:
    """Every int4 weight: an INT4 initializer (K, N), a (K/g, N) scale, DequantizeLinear axis 0 with block_size g,
    no zero point (TensorRT takes symmetric only); ONNX Runtime's result is the numpy dequantized matmul."""
    model = _matmul_model({"layers.0.mlp.up": (64, 48), "layers.0.mlp.odd": (64, 40), "lm_head": (64, 24)})
    fp = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    x = np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)
    ref = _run(model, x)
    report = q.quantize_weights(model, "int4", 32)
    assert (report.int4_layers, report.int8_layers, report.int8_instead_of_int4) == (2, 1, ["lm_head/MatMul_0"])
    inits = {i.name: i for i in model.graph.initializer}
    assert not any(name.endswith("/weight_t") for name in inits)  # the fp32 weights are gone
    dqs = {n.name: n for n in model.graph.node if n.op_type == "DequantizeLinear"}
    up = dqs["layers.0.mlp.up/MatMul_0/DequantizeLinear"]
    attrs = {a.name: helper.get_attribute_value(a) for a in up.attribute}
    assert attrs == {"axis": 0, "block_size": 32} and len(up.input) == 2
    qw, scale = inits[up.input[0]], numpy_helper.to_array(inits[up.input[1]])
    assert qw.data_type == TensorProto.INT4 and list(qw.dims) == [64, 48] and scale.shape == (2, 48)
    assert len(qw.raw_data) == 64 * 48 // 2
    values = numpy_helper.to_array(qw).astype(np.int8)
    assert values.min() >= -7 and values.max() <= 7
    # the first value of each byte sits in its low nibble (TensorRT's and ONNX's INT4 layout)
    first = int(qw.raw_data[0])
    assert ((first & 0xF) ^ 8) - 8 == values.reshape(-1)[0] and ((first >> 4) ^ 8) - 8 == values.reshape(-1)[1]
    deq = q.dequantize(values, scale, 32)
    assert np.abs(deq - fp["layers.0.mlp.up/weight_t"]).max() <= scale.max() / 2 + 1e-7  # round to nearest
    head = dqs["lm_head/MatMul_0/DequantizeLinear"]
    assert {a.name: helper.get_attribute_value(a) for a in head.attribute} == {"axis": 1}
    assert inits[head.input[0]].data_type == TensorProto.INT8 and list(inits[head.input[1]].dims) == [24]
    onnx.checker.check_model(model, full_check=True)
    got = _run(model, x)
    np.testing.assert_allclose(got[0], x @ deq, rtol=1e-5, atol=1e-5)
    for g, r in zip(got, ref):  # int4 at group 32 on 0.05-scale weights: close to fp32, not equal
        assert 0 < np.abs(g - r).max() < 0.1


def test_int4_falls_back_to_int8_where_k_is_not_a_multiple_of_the_group() -> None:
    model = _matmul_model({"layers.0.mlp.down": (96, 16)})
    report = q.quantize_weights(model, "int4", 64)
    assert report.int4_layers == 0 and report.int8_instead_of_int4 == ["layers.0.mlp.down/MatMul_0"]
    assert {i.data_type for i in model.graph.initializer} == {TensorProto.INT8, TensorProto.FLOAT}


def test_int8_is_per_output_channel() -> None:
    model = _matmul_model({"a": (64, 32)})
    w = numpy_helper.to_array(model.graph.initializer[0])
    report = q.quantize_weights(model, "int8", None)
    assert (report.int8_layers, report.group_size) == (1, None)
    dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear")
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    values, scale = inits[dq.input[0]], inits[dq.input[1]]
    assert values.dtype == np.int8 and scale.shape == (32,)
    np.testing.assert_allclose(scale, np.abs(w).max(axis=0) / 127, rtol=1e-6)
    assert np.abs(q.dequantize(values, scale, None) - w).max() <= scale.max() / 2 + 1e-7


def test_bad_modes_are_input_errors() -> None:
    for mode, group in (("int4", 48), ("int4", None), ("int2", 32)):
        with pytest.raises(InputError, match="int4|int8"):
            q.quantize_weights(_matmul_model({"a": (64, 16)}), mode, group)  # type: ignore[arg-type]


class _DeferredBuilds(dict):
    """(weights, group) -> the trained default model's deferred nvidia artifact, built once by kvexport.build (from
    the one export of the default model at max_seq 256 the run's other targets and modes share)."""

    def __init__(self, root: Path, tmp_path_factory: pytest.TempPathFactory):
        super().__init__()
        self.root, self.factory = root, tmp_path_factory
        self.ckpt = default_checkpoint_once(tmp_path_factory)

    def __missing__(self, mode: tuple[str, int | None]) -> Path:
        from kvexport.build import build

        weights, group = mode
        with exports_made_once(self.factory):
            self[mode] = build(self.ckpt, self.root / f"{weights}-{group}.kvx", target="nvidia", max_seq=256,
                               verify=False, options=BuildOptions(weights=weights, group_size=group, max_batch=2,
                                                                  extra={"defer": True}))
        return self[mode]


@pytest.fixture(scope="module")
def deferred(tmp_path_factory: pytest.TempPathFactory) -> _DeferredBuilds:
    return _DeferredBuilds(tmp_path_factory.mktemp("nv-quant"), tmp_path_factory)


def test_lowered_default_model_reads_every_matmul_weight_through_dequantize(deferred) -> None:  # type: ignore[no-untyped-def]
    """After every pass: all 17 MatMul weights come from DequantizeLinear, the scales (and the DQ outputs) are
    fp16, and the weights take under half the fp16 graph's bytes (the fp16 embedding stays)."""
    folder, m = open_artifact(deferred[("int4", 32)])
    src = folder / m.raw["ir"]["file"]  # the fp32 IR the artifact was lowered from
    rep16 = lower(onnx.load(str(src)), max_seq=m.max_seq, precision="fp16", pairs=m.kv_pairs())
    model = onnx.load(str(src))
    rep = lower(model, max_seq=m.max_seq, precision="fp16", pairs=m.kv_pairs(), weights="int4", group_size=32)
    producers = {o: n for n in model.graph.node for o in n.output}
    matmuls = [n for n in model.graph.node if n.op_type == "MatMul"]
    assert len(matmuls) == 17
    assert all(producers[n.input[1]].op_type == "DequantizeLinear" for n in matmuls)
    inits = {i.name: i for i in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "DequantizeLinear":
            assert inits[n.input[1]].data_type == TensorProto.FLOAT16
    assert rep.weights == {"mode": "int4", "group_size": 32, "int4_layers": 16, "int8_layers": 1,
                           "int8_instead_of_int4": ["lm_head/MatMul_0"]}
    assert rep.initializer_bytes < 0.45 * rep16.initializer_bytes
    assert m.target["weights"]["bytes"] == rep.initializer_bytes  # what the build recorded


@pytest.mark.parametrize("weights,group,key", [("int4", 32, "int4-g32+kv-fp16"), ("int8", None, "int8+kv-fp16")])
def test_packaged_quantized_graph_verifies_on_the_trained_model(deferred, weights: str, group: int | None,  # type: ignore[no-untyped-def]
                                                                key: str) -> None:
    """The deferred int8/int4 artifact of the trained default model: its packaged graph (what TensorRT parses),
    run by ONNX Runtime with the TensorRT session's slot model, passes its teacher-forced row; the manifest
    records the weights' mode, block and counted bytes."""
    from kvexport.runtime.engine import Engine
    from kvexport.verify import verify_engine

    folder, m = open_artifact(deferred[(weights, group)])
    t = m.target
    assert t["precision"] == weights and t["weights"]["dtype"] == weights and t["weights"]["group_size"] == group
    assert t["kv"]["dtype"] == "fp16" and t["options"]["model_dtype"] == "fp16"
    assert 0 < t["weights"]["bytes"] < m.raw["model"]["num_parameters"] * 2
    report = verify_engine(Engine(folder, m, OrtTwinSession(folder / ENGINE_DIR / PREPARED, m)), deferred.ckpt,
                           decode_steps=8)
    assert (report.backend, report.precision) == ("nvidia", key)
    assert report.mode == "teacher-forced"
    assert report.passed, report.failures


def test_int8_with_a_block_size_is_refused_before_export(tmp_path: Path) -> None:
    from kvexport.build import build
    from kvexport.zoo import DEFAULT_MODEL_DIR

    with pytest.raises(InputError, match="per output channel"):
        build(DEFAULT_MODEL_DIR, tmp_path / "x.kvx", target="nvidia", max_seq=64, verify=False,
              options=BuildOptions(weights="int8", group_size=128, extra={"defer": True}))
    assert not list(tmp_path.iterdir())


def test_int4_with_its_nibbles_swapped_fails_its_row(deferred, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A packing bug (each byte's two INT4 values in the other order, as TensorRT would read a graph packed
    high-nibble first) fails the int4 row on the text's measures."""
    from kvexport.runtime.engine import Engine
    from kvexport.verify import verify_engine

    folder, m = open_artifact(deferred[("int4", 32)])
    model = onnx.load(str(folder / ENGINE_DIR / PREPARED))
    swapped = 0
    for t in model.graph.initializer:
        if t.data_type == TensorProto.INT4:
            b = np.frombuffer(t.raw_data, dtype=np.uint8)
            t.raw_data = ((b << 4) | (b >> 4)).astype(np.uint8).tobytes()
            swapped += 1
    assert swapped == 16
    bad = tmp_path / "swapped.onnx"
    onnx.save_model(model, str(bad), save_as_external_data=True, location="swapped.onnx.data")
    report = verify_engine(Engine(folder, m, OrtTwinSession(bad, m)), deferred.ckpt, decode_steps=8)
    assert not report.passed
    assert any(f.startswith(("text", "held-out")) for f in report.failures), report.failures
