"""MoE routers stay fp32 in the fp16 graph: the experts they pick are the fp32 ones on near ties."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kvexport_nvidia.lowering import convert_precision
from kvexport_nvidia.router import cast_islands, find_routers

T, H, E, K = 64, 32, 8, 2


def _router_graph(w: np.ndarray, experts: np.ndarray) -> onnx.ModelProto:
    """MoeMlp's routing as the IR writes it: Gemm -> Softmax -> TopK, probs * 0 scattered with the top k,
    the (T, E) routing matrix weighting every expert's output (here one MatMul standing for the experts)."""
    nodes = [
        helper.make_node("Gemm", ["x", "router.weight"], ["logits"], transB=1, name="mlp.router/Gemm_0"),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=-1, name="mlp/Softmax_0"),
        helper.make_node("TopK", ["probs", "k"], ["top", "chosen"], name="mlp/TopK_0"),
        helper.make_node("Mul", ["probs", "zero"], ["zeros"], name="mlp/Mul_1"),
        helper.make_node("ScatterElements", ["zeros", "chosen", "top"], ["route"], axis=-1, name="mlp/ScatterElements_0"),
        helper.make_node("MatMul", ["x", "experts"], ["each"], name="mlp/MatMul_experts"),  # (T, E)
        helper.make_node("Mul", ["each", "route"], ["y"], name="mlp/Mul_route"),
        helper.make_node("Mul", ["x", "zero"], ["x0"], name="other/Mul_shares_zero"),  # shares the constant
    ]
    inits = [numpy_helper.from_array(w, "router.weight"), numpy_helper.from_array(experts, "experts"),
             numpy_helper.from_array(np.array([K], np.int64), "k"), numpy_helper.from_array(np.float32(0), "zero")]
    graph = helper.make_graph(nodes, "router", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, H])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [T, E]),
                               helper.make_tensor_value_info("chosen", TensorProto.INT64, [T, K]),
                               helper.make_tensor_value_info("x0", TensorProto.FLOAT, [T, H])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)], ir_version=10)


@pytest.fixture(scope="module")
def near_ties() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Router weights whose 2nd and 3rd experts differ by ~1e-4 in logit: inside fp16's rounding of the
    logits (|logit| ~ 1, a step of 1e-3), far outside fp32's."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((T, H)).astype(np.float16).astype(np.float32)  # what the fp16 graph feeds it
    w = rng.standard_normal((E, H)).astype(np.float32) * 0.2
    w[2] = w[1] + rng.standard_normal(H).astype(np.float32) * 1e-4
    w[0] += 0.5 * np.sign(x.mean(0))  # a clear first choice, so the tie decides the second
    experts = rng.standard_normal((H, E)).astype(np.float32)
    return x, w, experts


def _run(model: onnx.ModelProto, x: np.ndarray) -> dict[str, np.ndarray]:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"x": x.astype(np.float16)})))


def _fp16(model: onnx.ModelProto, *, fp32_router: bool) -> onnx.ModelProto:
    routers = find_routers(model) if fp32_router else None
    convert_precision(model, "fp16", keep=routers.initializers if routers else ())
    if routers:
        cast_islands(model, routers, TensorProto.FLOAT16)
    return model


def test_router_island_holds_the_routing_nodes_and_its_own_constants(near_ties) -> None:  # type: ignore[no-untyped-def]
    model = _router_graph(*near_ties[1:])
    routers = find_routers(model)
    assert routers.nodes == ["mlp.router/Gemm_0", "mlp/Softmax_0", "mlp/TopK_0", "mlp/Mul_1", "mlp/ScatterElements_0"]
    assert routers.inputs == ["x"] and routers.outputs == ["route"]
    # "zero" is shared with a node outside: the island reads its own fp32 copy
    assert routers.initializers == {"router.weight", "zero/fp32"}
    model = _fp16(model, fp32_router=True)
    onnx.checker.check_model(model)
    types = {i.name: i.data_type for i in model.graph.initializer}
    assert types["router.weight"] == types["zero/fp32"] == TensorProto.FLOAT
    assert types["zero"] == types["experts"] == TensorProto.FLOAT16
    casts = {n.output[0]: n.attribute[0].i for n in model.graph.node if n.op_type == "Cast"}
    assert casts == {"x/fp32": TensorProto.FLOAT, "route": TensorProto.FLOAT16}


def test_fp32_router_picks_the_fp32_experts_where_fp16_flips_them(near_ties) -> None:  # type: ignore[no-untyped-def]
    x, w, experts = near_ties
    logits = x @ w.T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want = np.sort(np.argsort(-probs, -1)[:, :K], -1)
    got = _run(_fp16(_router_graph(w, experts), fp32_router=True), x)
    np.testing.assert_array_equal(np.sort(got["chosen"], -1), want)
    route = np.zeros_like(probs)
    np.put_along_axis(route, want, np.take_along_axis(probs, want, -1), -1)
    np.testing.assert_allclose(got["y"], (x @ experts) * route, rtol=2e-3, atol=2e-3)
    # the same graph routed in fp16 picks other experts on some of these rows: what the island is for
    flipped = _run(_fp16(_router_graph(w, experts), fp32_router=False), x)
    assert (np.sort(flipped["chosen"], -1) != want).any(-1).sum() >= 1
