"""The lowering passes: the rewritten graph still runs in ONNX Runtime and matches the reference."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from kvexport.errors import UnsupportedFeatureError
from kvexport_nvidia import lowering
from kvexport_nvidia.lowering import lower

from nvidia_ort_twin import MAX_SEQ


@pytest.fixture(scope="module")
def ir(tiny_ir: Path) -> tuple[onnx.ModelProto, list[tuple[str, str]]]:
    raw = json.loads((tiny_ir / "manifest.json").read_text())
    pairs = [(p["input"], p["output"]) for p in raw["cache"]["pairs"]]
    return onnx.load(str(tiny_ir / "model.onnx")), pairs


def _lowered(ir, precision: str) -> onnx.ModelProto:  # type: ignore[no-untyped-def]
    model = copy.deepcopy(ir[0])
    lower(model, max_seq=MAX_SEQ, precision=precision, pairs=ir[1])  # type: ignore[arg-type]
    return model


def _run_steps(model: onnx.ModelProto, cache_dtype: type, cache_len: int) -> list[np.ndarray]:
    """Prefill 5 tokens on 2 rows (row 1 left-padded by 2), then 3 decode steps; logits per step."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    caches = {i.name: np.zeros((2, 2, cache_len, 16), cache_dtype) for i in sess.get_inputs() if i.name.startswith("past")}
    outs = [o.name for o in sess.get_outputs()]
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 300, (2, 5))
    pad = np.array([0, 2])
    pos = np.maximum(np.arange(5)[None] - pad[:, None], 0)
    held, results = 0, []
    for step in range(4):
        S = ids.shape[1]
        slot = np.arange(cache_len)
        qslot = held + np.arange(S)
        mask = (slot[None, None, :] <= qslot[None, :, None]) & (slot[None, None, :] >= pad[:, None, None])
        feeds = {"input_ids": ids, "position_ids": pos, "write_index": np.full(2, held, np.int64),
                 "attention_mask": mask[:, None], **caches}
        res = dict(zip(outs, sess.run(None, feeds)))
        results.append(res["logits"][:, -1].astype(np.float32))
        caches = {k: res[k.replace("past_key_values", "present")] for k in caches}
        held += S
        ids = results[-1].argmax(-1)[:, None]
        pos = pos[:, -1:] + 1
    return results


def test_passes_keep_the_function_fp32_twin(ir) -> None:  # type: ignore[no-untyped-def]
    """Pinning, the RoPE rewrite and the attention trim change no number: exact against the IR."""
    ref = _run_steps(ir[0], np.float32, MAX_SEQ)
    got = _run_steps(_lowered(ir, "fp32"), np.float32, MAX_SEQ)
    for r, g in zip(ref, got):
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=0)


def test_lowered_graph_has_the_parser_form(ir) -> None:  # type: ignore[no-untyped-def]
    model = _lowered(ir, "fp16")
    g = model.graph
    inputs = {i.name: i for i in g.input}
    for vi in [*g.input, *g.output]:
        dims = [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
        assert "cache_len" not in dims, vi.name
        if vi.name.startswith(("past_key_values", "present")):
            assert dims[2] == MAX_SEQ
    producers = {o: n for n in g.node for o in n.output}
    ropes = [n for n in g.node if n.op_type == "RotaryEmbedding"]
    assert len(ropes) == 4
    for n in ropes:
        assert all(a.name != "num_heads" for a in n.attribute)  # 4-D form: heads from the shape
        assert producers[n.input[0]].op_type == "Transpose"
        assert n.input[3] == "position_ids" and inputs["position_ids"].type.tensor_type.elem_type == TensorProto.INT64
    for n in g.node:
        if n.op_type == "Attention":
            assert len(n.output) == 1 and len(n.input) == 4  # q, k, v, explicit bool mask
        if n.op_type == "TensorScatter":
            assert n.input[0] in inputs and n.output[0] in {o.name for o in g.output}


def test_fp16_dtypes_and_fp32_logits(ir) -> None:  # type: ignore[no-untyped-def]
    model = _lowered(ir, "fp16")
    g = model.graph
    assert {i.data_type for i in g.initializer} <= {TensorProto.FLOAT16, TensorProto.INT64}
    elem = {vi.name: vi.type.tensor_type.elem_type for vi in [*g.input, *g.output]}
    assert elem["past_key_values.0.key"] == elem["present.1.value"] == TensorProto.FLOAT16
    assert elem["logits"] == TensorProto.FLOAT
    last = [n for n in g.node if "logits" in n.output]
    assert last[0].op_type == "Cast"
    # and the graph runs in fp16 in ONNX Runtime, close to the fp32 IR
    ref = _run_steps(ir[0], np.float32, MAX_SEQ)
    got = _run_steps(model, np.float16, MAX_SEQ)
    for r, h in zip(ref, got):
        assert (r.argmax(-1) == h.argmax(-1)).all()
        assert np.abs(r - h).max() < 0.05


def test_fp32_graph_is_float32_throughout(ir) -> None:  # type: ignore[no-untyped-def]
    """The fp32 engine's graph: the parser form of the fp16 one with no dtype conversion at all, so the
    strongly typed network TensorRT parses from it (trt_build.check_precision) holds no 16-bit tensor."""
    model = copy.deepcopy(ir[0])
    report = lower(model, max_seq=MAX_SEQ, precision="fp32", pairs=ir[1])
    g = model.graph
    assert {i.data_type for i in g.initializer} <= {TensorProto.FLOAT, TensorProto.INT64}
    elem = {vi.name: vi.type.tensor_type.elem_type for vi in [*g.input, *g.output]}
    assert elem["past_key_values.0.key"] == elem["present.1.value"] == elem["logits"] == TensorProto.FLOAT
    casts = [helper.get_attribute_value(a) for n in g.node if n.op_type == "Cast" for a in n.attribute if a.name == "to"]
    assert not {TensorProto.FLOAT16, TensorProto.BFLOAT16} & set(casts)
    assert not [n for n in g.node if "logits" in n.output and n.op_type == "Cast"]  # logits straight from lm_head
    assert report.precision == "fp32" and report.fp16_clipped == 0 and report.fp32_layers == []
    fp16 = _lowered(ir, "fp16")
    ops = lambda m: sorted(n.op_type for n in m.graph.node if n.op_type != "Cast")  # noqa: E731
    assert ops(model) == ops(fp16)  # the same layers for IAttention, IKVCacheUpdateLayer, RoPE as the fp16 engine's


def test_bf16_weights_round_like_torch(ir) -> None:  # type: ignore[no-untyped-def]
    """ONNX Runtime has no bf16 Attention kernel on CPU: the bf16 graph is checked by structure
    and by its weights, which must be torch's round-to-nearest-even bf16 of the fp32 ones."""
    model = _lowered(ir, "bf16")
    src = {i.name: numpy_helper.to_array(i) for i in ir[0].graph.initializer if i.data_type == TensorProto.FLOAT}
    conv = {i.name: i for i in model.graph.initializer}
    name = "layers.0.attn.qkv_proj/weight_t"
    assert conv[name].data_type == TensorProto.BFLOAT16
    want = torch.from_numpy(src[name].copy()).to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    assert conv[name].raw_data == want
    assert all(conv[n].data_type == TensorProto.BFLOAT16 for n in src)
    onnx.checker.check_model(model)


def test_fp16_clips_out_of_range_weights() -> None:
    w = np.array([1.0, 7e4, -1e5], np.float32)
    g = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["logits"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [3])],
                          [numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 24)])
    assert lowering.convert_precision(m, "fp16") == 2
    out = numpy_helper.to_array(m.graph.initializer[0])
    assert out.dtype == np.float16 and out.max() == 65504 and out.min() == -65504


# --- refusals: every one raises before an engine build, naming the node and the way out ---------
def test_attention_with_a_used_second_output_is_refused(ir) -> None:  # type: ignore[no-untyped-def]
    model = copy.deepcopy(ir[0])
    att = next(n for n in model.graph.node if n.op_type == "Attention")
    att.output.extend(["pk", "pv"])
    model.graph.node.append(helper.make_node("Identity", ["pk"], ["pk_used"]))
    with pytest.raises(UnsupportedFeatureError, match="one output only"):
        lowering.trim_attention_outputs(model)


def test_attention_unused_outputs_are_trimmed(ir) -> None:  # type: ignore[no-untyped-def]
    model = copy.deepcopy(ir[0])
    att = next(n for n in model.graph.node if n.op_type == "Attention")
    att.output.extend(["", "", "qk_unused"])
    assert lowering.trim_attention_outputs(model) == 1
    assert len(att.output) == 1


def test_attention_past_inputs_are_refused(ir) -> None:  # type: ignore[no-untyped-def]
    model = copy.deepcopy(ir[0])
    att = next(n for n in model.graph.node if n.op_type == "Attention")
    att.input.extend(["past_key_values.0.key", "past_key_values.0.value"])
    with pytest.raises(UnsupportedFeatureError, match="static-cache IR"):
        lowering.trim_attention_outputs(model)


def test_cache_write_must_pair_graph_input_and_output(ir) -> None:  # type: ignore[no-untyped-def]
    model = copy.deepcopy(ir[0])
    with pytest.raises(UnsupportedFeatureError, match="manifest pairs"):
        lowering.check_cache_io(model, [(a, b) for (a, _), (_, b) in zip(ir[1], ir[1][1:] + ir[1][:1])])
    scatter = next(n for n in model.graph.node if n.op_type == "TensorScatter")
    scatter.input[0] = "not_an_input"
    with pytest.raises(UnsupportedFeatureError, match="graph input"):
        lowering.check_cache_io(model, ir[1])


def test_identity_between_cache_write_and_output_is_folded(ir) -> None:  # type: ignore[no-untyped-def]
    model = copy.deepcopy(ir[0])
    scatter = next(n for n in model.graph.node if n.op_type == "TensorScatter")
    out = scatter.output[0]
    scatter.output[0] = out + "_inner"
    for n in model.graph.node:
        for i, name in enumerate(n.input):
            if name == out:
                n.input[i] = out + "_inner"
    model.graph.node.append(helper.make_node("Identity", [out + "_inner"], [out]))
    assert lowering.fold_cache_identities(model) == 1
    lowering.check_cache_io(model, ir[1])
    assert scatter.output[0] == out


def test_unsupported_ops_are_listed_at_once(ir) -> None:  # type: ignore[no-untyped-def]
    model = copy.deepcopy(ir[0])
    model.graph.node.append(helper.make_node("NonZero", ["input_ids"], ["nz"]))
    model.graph.node.append(helper.make_node("Foo", ["input_ids"], ["foo"], domain="custom"))
    with pytest.raises(UnsupportedFeatureError, match="NonZero, custom::Foo"):
        lowering.check_ops(model)
