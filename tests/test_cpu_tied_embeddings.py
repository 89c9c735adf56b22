"""cpu int8/int4 weights on a model with tied embeddings (tiny qwen2): the embedding Gather reads the lm_head
MatMulNBits' own blocks through GatherBlockQuantized, the fp32 table is gone, and every embedding row is the
lm_head's dequantized row (random weights: exactness against the head is what is judged here; the lossy
modes' accuracy is judged on the trained default model in test_cpu_weights.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from kvexport.artifact import open_artifact
from kvexport.backends import BuildOptions
from kvexport.backends.cpu import ENGINE_DIR, OPT_MODEL
from kvexport.build import build
from kvexport.errors import InputError

# the default int4 build's lm_head is 8-bit like int8's: these two cover both heads' bits. int8 at its default
# block: 32 on a CPU with int8 dot products; 128 without, wider than the tiny families' hidden size (64), so each
# matrix's block is fitted to its rows (cpu_quant.fitted_block) and the table is still whole blocks of 64
MODES = {"int4+head-int4": BuildOptions(weights="int4", extra={"lm_head": "int4"}),
         "int8": BuildOptions(weights="int8")}


@pytest.fixture(scope="module")
def tied(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("cpu-tied")
    return {mode: build(checkpoints["qwen2"], out / f"{mode}.kvx", target="cpu", max_seq=64, options=opts,
                        verify=False) for mode, opts in MODES.items()}


def _rows_and_head(art: Path) -> tuple[np.ndarray, np.ndarray, int]:
    """The embedding rows GatherBlockQuantized gives for every token id, and the lm_head's dequantized
    (vocab, hidden) weight, both run by ONNX Runtime on the engine's own initializers."""
    model = onnx.load(str(art / ENGINE_DIR / OPT_MODEL))
    nodes = {n.op_type: n for n in model.graph.node}
    gbq, head = nodes["GatherBlockQuantized"], next(n for n in model.graph.node if n.output[0] == "logits")
    reshape = next(n for n in model.graph.node if n.output[0] == gbq.input[0])
    attrs = {a.name: a.i for a in head.attribute}
    vocab, hidden = attrs["N"], attrs["K"]
    inits = [t for t in model.graph.initializer if t.name in {*reshape.input, *head.input[1:]}]
    g = helper.make_graph(
        [reshape, helper.make_node("GatherBlockQuantized", [gbq.input[0], "ids", gbq.input[2]], ["rows"],
                                   domain="com.microsoft", **{a.name: a.i for a in gbq.attribute}),
         helper.make_node("MatMulNBits", ["x", *head.input[1:]], ["y"], domain="com.microsoft", **attrs)],
        "probe", [helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [vocab]),
                  helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [hidden, hidden])],
        [helper.make_tensor_value_info("rows", onnx.TensorProto.FLOAT, [vocab, hidden]),
         helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [hidden, vocab])], inits)
    probe = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    probe.ir_version = 10
    sess = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    rows, y = sess.run(None, {"ids": np.arange(vocab), "x": np.eye(hidden, dtype=np.float32)})
    return rows, y.T, attrs["bits"]


@pytest.mark.parametrize("mode", list(MODES))
def test_tied_embeddings_read_the_heads_blocks(mode: str, tied: dict[str, Path]) -> None:
    art = tied[mode]
    model = onnx.load(str(art / ENGINE_DIR / OPT_MODEL), load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("GatherBlockQuantized") == 1 and "Gather" not in ops
    cfg = open_artifact(art)[1].config
    table = [t for t in model.graph.initializer if list(t.dims) == [cfg.vocab_size, cfg.hidden_size]]
    assert table == []  # no fp32 (vocab, hidden) table left
    rows, head, bits = _rows_and_head(art)
    assert bits == (4 if mode.startswith("int4+head") else 8)
    np.testing.assert_allclose(rows, head, rtol=0, atol=1e-6)  # one table: embedding row == head row
    # and both are the IR's fp32 table within a block's quantization step
    ir = onnx.load(str(art / open_artifact(art)[1].raw["ir"]["file"]))
    fp32 = next(numpy_helper.to_array(t) for t in ir.graph.initializer
                if list(t.dims) == [cfg.vocab_size, cfg.hidden_size])
    step = np.abs(fp32).max() / (7 if bits == 4 else 127)
    assert 0 < np.abs(rows - fp32).max() <= step
    w = open_artifact(art)[1].target["weights"]
    assert w["embeddings"].startswith("GatherBlockQuantized") and w["lm_head_bits"] == bits


def test_the_tied_engine_is_smaller_by_the_table(tied: dict[str, Path]) -> None:
    """int8 blocks of 32 or more with fp32 scales cost at most 1.125 bytes a weight: counted with the fp32 table
    kept beside them (4 bytes a weight of it), the engine would pass 1.125 bytes a parameter by over half the
    table."""
    m = open_artifact(tied["int8"])[1]
    table = 4 * m.config.vocab_size * m.config.hidden_size
    assert m.target["weights"]["bytes"] < 1.125 * m.raw["model"]["num_parameters"] + table / 2


def test_lm_head_option_is_refused_where_it_means_nothing(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    for opts, match in ((BuildOptions(weights="int8", extra={"lm_head": "int4"}), "drop the option"),
                        (BuildOptions(extra={"lm_head": "int4"}), "--weights fp32"),
                        (BuildOptions(weights="int4", group_size=128, extra={"lm_head": "int4"}), "no tolerance row"),
                        (BuildOptions(weights="int4", extra={"lm_head": "int2"}), "int8, int4")):
        with pytest.raises(InputError, match=match):
            build(checkpoints["qwen2"], tmp_path / "x.kvx", target="cpu", options=opts, verify=False)
        assert not (tmp_path / "x.kvx").exists()
