"""GPTQ's rounding (kvexport/backends/cpu_gptq.py) on single matrices: its blocks are ONNX Runtime's
MatMulNBits format byte for byte (without statistics it is that quantizer's round-to-nearest), and with
correlated inputs the layer's output moves less than under round-to-nearest. Whole builds are judged on
the trained model in tests/test_cpu_weights.py."""
from __future__ import annotations

import logging

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from kvexport.backends.cpu_gptq import blocks, factor


def _ort_blocks(w: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """What onnxruntime's own quantizer writes for one MatMul by `w`, symmetric."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    k, n = w.shape
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    config = DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=True, accuracy_level=0, bits=bits,
                                          op_types_to_quantize=("MatMul",))
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    q = MatMulNBitsQuantizer(model, bits=bits, block_size=block, is_symmetric=True, accuracy_level=0,
                             algo_config=config)
    q.process()
    node = next(n for n in q.model.model.graph.node if n.op_type == "MatMulNBits")
    inits = {t.name: numpy_helper.to_array(t) for t in q.model.model.graph.initializer}
    return inits[node.input[1]], inits[node.input[2]]


def _dequantized(packed: np.ndarray, scales: np.ndarray, bits: int, k: int) -> np.ndarray:
    """(K, N) float weights the kernel computes with, from (N, K_blocks, blob) blocks and (N, K_blocks) scales."""
    n, nb, _ = packed.shape
    if bits == 4:
        q = np.stack([packed & 15, packed >> 4], axis=-1).reshape(n, nb, -1)
    else:
        q = packed
    w = (q.astype(np.float32) - 2 ** (bits - 1)) * scales.reshape(n, nb)[..., None]
    return w.reshape(n, -1)[:, :k].T


@pytest.mark.parametrize("k,n,bits,block", [(64, 8, 4, 32), (80, 8, 4, 32), (96, 16, 8, 32), (256, 24, 4, 128),
                                            (200, 5, 8, 64)])
def test_without_statistics_the_blocks_are_onnxruntimes_own(k: int, n: int, bits: int, block: int) -> None:
    w = np.random.default_rng(k + n).standard_normal((k, n)).astype(np.float32)
    w[:, 1] = 0.0  # an all-zero output: scale 0, every q at the zero point
    w[:block, 2] *= 1e-3
    packed, scales = blocks(w, bits, block)
    ref_packed, ref_scales = _ort_blocks(w, bits, block)
    assert packed.shape == ref_packed.shape and packed.dtype == np.uint8
    assert np.array_equal(packed, ref_packed)  # padded tails (80 of 96, 200 of 256) included
    assert np.array_equal(scales, ref_scales.reshape(scales.shape))


def test_uncorrelated_inputs_leave_nothing_to_spread() -> None:
    """H proportional to the identity: no column's error reaches another, so GPTQ is round-to-nearest."""
    k, n = 128, 16
    w = np.random.default_rng(1).standard_normal((k, n)).astype(np.float32)
    x = 3.0 * np.eye(k, dtype=np.float32)
    for bits, block in ((4, 32), (8, 64)):
        got = blocks(w, bits, block, factor(x))
        want = blocks(w, bits, block)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


@pytest.mark.parametrize("bits,block", [(4, 32), (4, 128), (8, 32)])
def test_correlated_inputs_move_the_output_less_than_round_to_nearest(bits: int, block: int) -> None:
    rng = np.random.default_rng(bits * block)
    k, n, tokens = 256, 64, 1024
    mix = rng.standard_normal((k, k)).astype(np.float32) * np.linspace(1.0, 0.05, k, dtype=np.float32)
    x = rng.standard_normal((tokens, k)).astype(np.float32) @ mix.T  # strongly correlated features
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    rtn = _dequantized(*blocks(w, bits, block), bits, k)
    gptq = _dequantized(*blocks(w, bits, block, factor(x)), bits, k)
    e_rtn = np.linalg.norm(x @ (w - rtn))
    e_gptq = np.linalg.norm(x @ (w - gptq))
    assert e_gptq < 0.8 * e_rtn, (e_gptq, e_rtn)
    # held-out inputs from the same distribution: the gain is not a fit to the calibration rows
    x2 = rng.standard_normal((tokens, k)).astype(np.float32) @ mix.T
    assert np.linalg.norm(x2 @ (w - gptq)) < 0.8 * np.linalg.norm(x2 @ (w - rtn))


def test_an_input_that_was_always_zero_gets_zero_weights() -> None:
    rng = np.random.default_rng(5)
    k, n = 64, 8
    x = rng.standard_normal((256, k)).astype(np.float32)
    x[:, 10] = 0.0
    w = rng.standard_normal((k, n)).astype(np.float32)
    fac = factor(x)
    assert bool(fac[1][10]) and int(fac[1].sum()) == 1
    deq = _dequantized(*blocks(w, 4, 32, fac), 4, k)
    assert np.all(deq[10] == 0.0) and np.all(np.isfinite(deq))


def test_nodes_the_quantizer_named_otherwise_are_an_error_not_a_silent_rtn() -> None:
    from onnx import helper

    from kvexport.backends.cpu_gptq import apply
    from kvexport.errors import UnsupportedFeatureError

    w = np.ones((32, 4), np.float32)
    node = helper.make_node("MatMulNBits", ["x", "w_q", "w_s"], ["y"], name="mm_renamed", domain="com.microsoft",
                            K=32, N=4, bits=4, block_size=32)
    model = helper.make_model(helper.make_graph([node], "g", [], []))
    with pytest.raises(UnsupportedFeatureError, match="found 0 of the 1 .*quantizer=rtn"):
        apply(model, {"mm": w}, {"mm": "x"}, {"x": np.ones((8, 32), np.float32)}, lambda _: None)


def test_the_original_weights_are_read_from_disk_one_at_a_time(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """GPTQ reads each fp32 matrix from the engine's external data file when it rounds it (a copy of them all
    beside the loaded model would be a 1B model's 4 GB more); a weight stored inline comes from the graph."""
    import onnx
    from onnx import helper

    from kvexport.backends.cpu_quant import WeightsOnDisk

    rng = np.random.default_rng(3)
    big, small = rng.standard_normal((64, 48)).astype(np.float32), rng.standard_normal((4, 2)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "big"], ["h"], name="a"),
                               helper.make_node("MatMul", ["h", "small_w"], ["y"], name="b")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])],
                              [numpy_helper.from_array(big, "big"), numpy_helper.from_array(small, "small_w")])
    path = tmp_path / "m.onnx"
    onnx.save_model(helper.make_model(graph), str(path), save_as_external_data=True, location="m.onnx.data",
                    size_threshold=1024)  # `small_w` stays inline
    got = WeightsOnDisk(path, onnx.load(str(path), load_external_data=False), ["a", "b"])
    assert sorted(got) == ["a", "b"] and len(got) == 2
    assert isinstance(got.places["a"], tuple) and np.array_equal(got["a"], big)  # a place, read when asked
    assert np.array_equal(got["b"], small)


def test_the_triangular_inverse_by_halves_is_the_inverse() -> None:
    import torch

    from kvexport.backends.cpu_gptq import _upper_inverse

    g = torch.Generator().manual_seed(0)
    for n in (300, 1100):  # one solve; three levels of halving with odd halves
        a = torch.triu(torch.randn(n, n, generator=g) * 0.1) + 2.0 * torch.eye(n)
        got = _upper_inverse(a)
        assert torch.equal(got, torch.triu(got))
        assert float((got @ a - torch.eye(n)).abs().max()) < 1e-4
