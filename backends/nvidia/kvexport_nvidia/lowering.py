"""IR passes that turn the static-cache IR into the graph TensorRT's ONNX parser imports natively.

The parser maps `TensorScatter` onto IKVCacheUpdateLayer, `Attention` onto IAttention and
`RotaryEmbedding` onto IRotaryEmbeddingLayer, with conditions the exported IR does not meet as is:
the cache needs a static sequence length (we pin `cache_len` to max_seq), IRotaryEmbeddingLayer
takes (B, N, S, H) input (the IR feeds RoPE (B, S, N*H) with `num_heads`), `Attention` may have
only its first output, and on TensorRT 11 the ONNX dtypes decide precision (we convert the fp32
IR to fp16/bf16, keeping the logits fp32, or leave it fp32 for an fp32 engine). Every pass keeps the graph runnable in ONNX Runtime,
which is how the tests hold them to the reference.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kvexport.errors import UnsupportedFeatureError
from kvexport_nvidia.graph import all_nodes as _all_nodes
from kvexport_nvidia.graph import attr as _attr
from kvexport_nvidia.graph import rewrite_nodes as _rewrite_nodes
from kvexport_nvidia.graph import subgraphs as _subgraphs
from kvexport_nvidia.quantize import WeightMode, check_mode, initializer_bytes, quantize_weights
from kvexport_nvidia.rings import circular_to_scatter, is_circular, pin_ring_len
from kvexport_nvidia.router import cast_islands, find_routers

Precision = Literal["fp16", "bf16", "fp32"]
ELEM = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16, "fp32": TensorProto.FLOAT}
FP16_MAX = 65504.0
LOGITS = "logits"
CACHE_DIM = "cache_len"

# Op types of the static IR that TensorRT 10.15+ imports (docs: onnx-tensorrt operators.md). A
# graph holding anything else is refused before a long build, naming the op.
PARSER_OPS = frozenset({
    "Add", "Attention", "Cast", "Concat", "Constant", "ConstantOfShape", "DequantizeLinear", "Div", "Equal", "Erf",
    "Expand",
    "Gather", "Gelu", "Identity", "LayerNormalization", "MatMul", "Mul", "Neg", "Pow", "RMSNormalization",
    "Reshape", "RotaryEmbedding", "Shape", "Sigmoid", "Slice", "Softmax", "Split", "Sqrt", "Squeeze", "Sub",
    "Tanh", "TensorScatter", "Transpose", "Unsqueeze", "Where", "Relu", "ReduceMean", "Tile", "Range",
    "TopK", "ScatterElements", "ReduceSum",  # mixture-of-experts routing (TopK: K must be an initializer)
    # MoeMlp: a 2-D router Linear is a Gemm; the If on the token count picks the GatherND of the chosen
    # experts (decode) or the dense form (If: both branches' outputs of the same rank, different names)
    "Gemm", "GatherND", "If",
    "Less", "And",  # a sliding-window layer's band of the mask
    "Mod",  # a ring's write rows (rings.py): ScatterElements at (write_index + arange(S)) mod R
})


@dataclass
class LoweringReport:
    """What the passes changed; stored in the manifest's target options for `inspect`."""

    precision: str
    max_seq: int
    rope_rewritten: int = 0
    attention_decomposed: int = 0  # softcapped Attention nodes written as explicit ops (IAttention has no softcap)
    attention_outputs_trimmed: int = 0
    identities_folded: int = 0
    fp16_clipped: int = 0
    ring_len: int | None = None  # slots of the sliding layers' rings (None: no rings)
    ring_scatters: int = 0  # circular TensorScatter nodes written as ScatterElements (rings.py)
    fp32_layers: list[str] = field(default_factory=list)  # nodes kept fp32 in an fp16/bf16 graph: MoE routers
    ops: dict[str, int] = field(default_factory=dict)
    weights: dict | None = None  # quantize.WeightReport of an int8/int4 build
    initializer_bytes: int = 0  # weights (int4 at half a byte), scales and tables of the prepared graph

    def to_dict(self) -> dict:
        return dict(self.__dict__)


# --- passes ---------------------------------------------------------------------------------
def pin_cache_len(model: onnx.ModelProto, max_seq: int) -> None:
    """cache_len -> max_seq on every graph input/output: IKVCacheUpdateLayer needs a static S_max."""
    for vi in [*model.graph.input, *model.graph.output]:
        for d in vi.type.tensor_type.shape.dim:
            if d.dim_param == CACHE_DIM:
                d.Clear()
                d.dim_value = max_seq
    del model.graph.value_info[:]  # stale symbolic shapes; shape inference recomputes them


def rope_to_bnsh(model: onnx.ModelProto) -> int:
    """Rewrite 3-D RotaryEmbedding (B, S, N*H) + num_heads into the 4-D (B, N, S, H) form that
    IRotaryEmbeddingLayer takes: Reshape -> Transpose -> RoPE -> Transpose -> Reshape.
    TensorRT folds the transposes into the neighbouring ones that the IR already has."""
    return _rewrite_nodes(model, _rope_bnsh)


def _rope_bnsh(g: onnx.GraphProto, node: onnx.NodeProto, count: int) -> list[onnx.NodeProto] | None:
    heads = int(_attr(node, "num_heads", 0))  # type: ignore[arg-type]
    if node.op_type != "RotaryEmbedding" or not heads:
        return None
    n = node.name or f"RotaryEmbedding_{count}"
    x, y = node.input[0], node.output[0]
    bsnh, bnsh, rot_bnsh, rot_bsnh = (f"{n}/{s}" for s in ("bsnh", "bnsh", "rot_bnsh", "rot_bsnh"))
    # an explicit N with H inferred: the head count is the node's own attribute
    shape_in = _const_shape(g, f"kvx_rope_shape_bsnh_{heads}", [0, 0, heads, -1])
    shape_out = _const_shape(g, "kvx_rope_shape_bsd", [0, 0, -1])
    rope = helper.make_node("RotaryEmbedding", [bnsh, *node.input[1:]], [rot_bnsh], name=n)
    rope.attribute.extend(a for a in node.attribute if a.name != "num_heads")
    return [
        helper.make_node("Reshape", [x, shape_in], [bsnh], name=f"{n}/Reshape_in"),  # (B, S, N, H)
        helper.make_node("Transpose", [bsnh], [bnsh], perm=[0, 2, 1, 3], name=f"{n}/Transpose_in"),  # (B, N, S, H)
        rope,  # (B, N, S, H)
        helper.make_node("Transpose", [rot_bnsh], [rot_bsnh], perm=[0, 2, 1, 3], name=f"{n}/Transpose_out"),  # (B, S, N, H)
        helper.make_node("Reshape", [rot_bsnh, shape_out], [y], name=f"{n}/Reshape_out"),  # (B, S, N*H)
    ]


def decompose_softcapped_attention(model: onnx.ModelProto) -> int:
    """IAttention has no logit softcap (Gemma 2's `softcap` attribute): such an `Attention` becomes its
    explicit ops, scores = cap * tanh(q.k^T * scale / cap), masked, Softmax, times v, its K/V heads repeated
    for the query heads. TensorRT then runs that layer unfused. Returns how many were rewritten."""
    return _rewrite_nodes(model, _explicit_softcap_attention)


def _explicit_softcap_attention(g: onnx.GraphProto, node: onnx.NodeProto, count: int) -> list[onnx.NodeProto] | None:
    cap = float(_attr(node, "softcap", 0.0))  # type: ignore[arg-type]
    if node.op_type != "Attention" or not cap:
        return None
    if len(node.input) > 4 and any(node.input[4:]):
        raise UnsupportedFeatureError(f"{node.name}: a softcapped Attention with past inputs is not lowered; "
                                      "export the static-cache IR (kvexport build --target nvidia does)")
    n = node.name or f"Attention_{count}"
    q, k, v, mask = node.input[:4]
    hq, hkv = int(_attr(node, "q_num_heads", 0)), int(_attr(node, "kv_num_heads", 0))  # type: ignore[arg-type]
    scale = float(_attr(node, "scale", 0.0))  # type: ignore[arg-type]
    rep = hq // hkv if hq and hkv else 1
    c = {name: f"{n}/{name}" for name in ("axis2", "rep", "heads", "scale", "cap", "masked")}
    g.initializer.extend([
        helper.make_tensor(c["axis2"], TensorProto.INT64, [1], [2]),
        helper.make_tensor(c["rep"], TensorProto.INT64, [5], [1, 1, rep, 1, 1]),
        helper.make_tensor(c["heads"], TensorProto.INT64, [1], [hq]),
        helper.make_tensor(c["scale"], TensorProto.FLOAT, [], [scale]),
        helper.make_tensor(c["cap"], TensorProto.FLOAT, [], [cap]),
        # scores lie in [-cap, cap]: -30000 is exp() == 0 beside them in fp32, fp16 and bf16 alike
        helper.make_tensor(c["masked"], TensorProto.FLOAT, [], [-30000.0]),
    ])
    nodes: list[onnx.NodeProto] = []
    kv = [k, v]
    if rep > 1:  # (B, H_kv, L, D) -> (B, H_kv, rep, L, D) -> (B, H_q, L, D): query head h reads K/V head h // rep
        nodes += [helper.make_node("Shape", [k], [f"{n}/b"], end=1),
                  helper.make_node("Shape", [k], [f"{n}/ld"], start=2),
                  helper.make_node("Concat", [f"{n}/b", c["heads"], f"{n}/ld"], [f"{n}/bhld"], axis=0)]
        for j, name in enumerate(("k", "v")):
            nodes += [helper.make_node("Unsqueeze", [kv[j], c["axis2"]], [f"{n}/{name}5"]),
                      helper.make_node("Expand", [f"{n}/{name}5", c["rep"]], [f"{n}/{name}_rep5"]),
                      helper.make_node("Reshape", [f"{n}/{name}_rep5", f"{n}/bhld"], [f"{n}/{name}_rep"])]
            kv[j] = f"{n}/{name}_rep"
    s = f"{n}/scores"
    return nodes + [
        helper.make_node("Transpose", [kv[0]], [f"{s}_kt"], perm=[0, 1, 3, 2]),  # (B, H_q, D, L)
        helper.make_node("MatMul", [q, f"{s}_kt"], [f"{s}_qk"]),  # (B, H_q, S, L)
        helper.make_node("Mul", [f"{s}_qk", c["scale"]], [f"{s}_scaled"]),
        helper.make_node("Div", [f"{s}_scaled", c["cap"]], [f"{s}_over_cap"]),
        helper.make_node("Tanh", [f"{s}_over_cap"], [f"{s}_tanh"]),
        helper.make_node("Mul", [f"{s}_tanh", c["cap"]], [f"{s}_capped"]),
        helper.make_node("Where", [mask, f"{s}_capped", c["masked"]], [f"{s}_masked"]),
        helper.make_node("Softmax", [f"{s}_masked"], [f"{s}_probs"], axis=-1),
        helper.make_node("MatMul", [f"{s}_probs", kv[1]], [node.output[0]], name=f"{n}/MatMul_out"),  # (B, H_q, S, D)
    ]


def trim_attention_outputs(model: onnx.ModelProto) -> int:
    """TensorRT's Attention importer takes one output: drop unused optional ones (present_key,
    present_value, qk_matmul_output); refuse a graph that uses them."""
    used = _consumed(model)
    trimmed = 0
    for node in model.graph.node:
        if node.op_type != "Attention":
            continue
        if len(node.input) > 4 and any(node.input[4:]):
            raise UnsupportedFeatureError(
                f"{node.name}: Attention takes past_key/past_value/nonpad_kv_seqlen inputs, which TensorRT's "
                "importer does not support; the nvidia target lowers the static-cache IR (TensorScatter cache "
                "writes, explicit mask). Rebuild with `kvexport build --target nvidia`, which exports that IR."
            )
        extra = [o for o in node.output[1:] if o]
        if any(o in used for o in extra):
            raise UnsupportedFeatureError(
                f"{node.name}: Attention outputs {extra} are consumed, but TensorRT's Attention importer "
                "supports one output only; export the static-cache IR (cache_style='static')"
            )
        if len(node.output) > 1:
            del node.output[1:]
            trimmed += 1
    return trimmed


def fold_cache_identities(model: onnx.ModelProto) -> int:
    """IKVCacheUpdateLayer's output must itself be the network output aliased to the cache input:
    an Identity between TensorScatter and `present.*` is folded away."""
    g = model.graph
    outputs = {o.name for o in g.output}
    producers = {o: n for n in g.node for o in n.output}
    folded = 0
    for node in list(g.node):
        if node.op_type == "Identity" and node.output[0] in outputs:
            src = producers.get(node.input[0])
            if src is not None and src.op_type == "TensorScatter" and node.input[0] not in outputs:
                old, new = node.input[0], node.output[0]
                g.node.remove(node)
                for n in g.node:
                    for i, name in enumerate(n.input):
                        if name == old:
                            n.input[i] = new
                src.output[0] = new
                folded += 1
    return folded


def check_cache_io(model: onnx.ModelProto, pairs: list[tuple[str, str]], rings: bool = False) -> None:
    """Every TensorScatter reads a network input and writes its paired network output, so that
    present can be bound to past's device address (the layer updates the cache in place). rings: the
    manifest keeps sliding layers on rings, whose TensorScatter is circular (rewritten by rings.py)."""
    g = model.graph
    inputs = {i.name for i in g.input}
    outputs = {o.name for o in g.output}
    want = dict(pairs)
    seen: set[str] = set()
    for node in g.node:
        if node.op_type != "TensorScatter":
            continue
        cache, out = node.input[0], node.output[0]
        if cache not in inputs or out not in outputs:
            raise UnsupportedFeatureError(
                f"{node.name}: TensorScatter must read a graph input and write a graph output for TensorRT's "
                f"in-place KV-cache update (reads {cache!r}, writes {out!r}); re-export the IR with this kvexport"
            )
        if want.get(cache) != out:
            raise UnsupportedFeatureError(
                f"{node.name}: cache {cache!r} is written to {out!r}, but the manifest pairs it with "
                f"{want.get(cache)!r}; the artifact's IR and manifest disagree, rebuild it"
            )
        if _attr(node, "axis", -2) != -2 or (_attr(node, "mode", b"linear") not in (b"linear", "linear")
                                             and not (rings and is_circular(node))):
            raise UnsupportedFeatureError(f"{node.name}: TensorRT imports TensorScatter with axis=-2, mode=linear only "
                                          "(a ring's circular write needs the manifest's ring entry)")
        seen.add(cache)
    missing = sorted(set(want) - seen)
    if missing:
        raise UnsupportedFeatureError(
            f"cache inputs {missing[:4]} are not written by a TensorScatter: the nvidia target needs the "
            "static-cache IR (kvexport build --target nvidia exports it)"
        )


def check_ops(model: onnx.ModelProto) -> dict[str, int]:
    """Refuse op types outside the set TensorRT's parser imports, listing all of them at once."""
    nodes = list(_all_nodes(model.graph))  # an If's branches (MoeMlp's gathered and dense forms) included
    ops = Counter(n.op_type for n in nodes if n.domain in ("", "ai.onnx"))
    custom = sorted({f"{n.domain}::{n.op_type}" for n in nodes if n.domain not in ("", "ai.onnx")})
    unknown = sorted(set(ops) - PARSER_OPS) + custom
    if unknown:
        raise UnsupportedFeatureError(
            f"the IR holds ops the nvidia target does not lower: {', '.join(unknown)}; supported: "
            f"{', '.join(sorted(PARSER_OPS))}. Use --target cpu for this model, or report it."
        )
    return dict(sorted(ops.items()))


def convert_precision(model: onnx.ModelProto, precision: Precision, keep: Collection[str] = ()) -> int:
    """fp32 IR -> fp16/bf16 graph: weights, constants, casts and the cache I/O change dtype; the
    logits are cast back to fp32 at the end. TensorRT 11 takes precision from these dtypes, and a
    strongly typed network on 10.x does too. Initializers named in `keep` stay fp32 (the routers'
    islands, kvexport_nvidia.router). Returns how many fp16 weights were clipped to +-65504."""
    if precision == "fp32":
        return 0
    target = ELEM[precision]
    g = model.graph
    clipped = 0
    for i, init in enumerate(g.initializer):
        if init.data_type == TensorProto.FLOAT and init.name not in keep:
            new, c = _convert_tensor(init, precision)
            g.initializer[i].CopyFrom(new)
            clipped += c
    for node in _all_nodes(g):
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == TensorProto.FLOAT:
                new, c = _convert_tensor(a.t, precision)
                a.t.CopyFrom(new)
                clipped += c
            elif node.op_type == "Cast" and a.name == "to" and a.i == TensorProto.FLOAT:
                a.i = target
    for vi in g.input:
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            vi.type.tensor_type.elem_type = target
    for vi in g.output:
        if vi.type.tensor_type.elem_type != TensorProto.FLOAT:
            continue
        if vi.name != LOGITS:
            vi.type.tensor_type.elem_type = target
            continue
        inner = f"{LOGITS}_{precision}"
        for node in g.node:
            for j, o in enumerate(node.output):
                if o == LOGITS:
                    node.output[j] = inner
            for j, name in enumerate(node.input):
                if name == LOGITS:
                    node.input[j] = inner
        # fp32 logits: the sampler and the verify tolerances read them; the cast is one tiny kernel
        g.node.append(helper.make_node("Cast", [inner], [LOGITS], to=TensorProto.FLOAT, name="lm_head/Cast_logits"))
    del g.value_info[:]
    for sub in _subgraphs(g):  # an If's branch outputs are typed too
        for vi in sub.output:
            if vi.type.tensor_type.elem_type == TensorProto.FLOAT:
                vi.type.tensor_type.elem_type = target
        del sub.value_info[:]
    return clipped


# --- the whole lowering ---------------------------------------------------------------------
def lower(model: onnx.ModelProto, *, max_seq: int, precision: Precision, pairs: list[tuple[str, str]],
          check: bool = True, weights: WeightMode | None = None, group_size: int | None = None,
          ring_len: int | None = None) -> LoweringReport:
    """Run every pass in place, in order; raise UnsupportedFeatureError before any engine build.
    weights int8/int4: MatMul weights through DequantizeLinear (kvexport_nvidia.quantize), from the
    fp32 values, before the float weights and the scales become `precision`."""
    if weights is not None:
        check_mode(weights, group_size)
    report = LoweringReport(precision=precision, max_seq=max_seq)
    report.attention_decomposed = decompose_softcapped_attention(model)
    report.ops = check_ops(model)
    report.attention_outputs_trimmed = trim_attention_outputs(model)
    report.identities_folded = fold_cache_identities(model)
    check_cache_io(model, pairs, rings=ring_len is not None)
    pin_cache_len(model, max_seq)
    if ring_len is not None:
        report.ring_len = ring_len
        pin_ring_len(model, ring_len)
        report.ring_scatters = circular_to_scatter(model, ring_len)
    report.rope_rewritten = rope_to_bnsh(model)
    if weights is not None:
        report.weights = quantize_weights(model, weights, group_size).to_dict()
    routers = find_routers(model) if precision != "fp32" else None  # MoE routing stays fp32 (router.py)
    report.fp16_clipped = convert_precision(model, precision, keep=routers.initializers if routers else ())
    if routers is not None:
        cast_islands(model, routers, ELEM[precision])
        report.fp32_layers = routers.nodes
    report.initializer_bytes = initializer_bytes(model)
    if check:
        onnx.checker.check_model(model, full_check=False)
    return report


def lower_file(src: Path, dst: Path, *, max_seq: int, precision: Precision, pairs: list[tuple[str, str]],
               weights: WeightMode | None = None, group_size: int | None = None,
               ring_len: int | None = None) -> LoweringReport:
    """Read the artifact's IR (with its external weights), lower it, write dst + dst.data."""
    model = onnx.load(str(src), load_external_data=True)
    report = lower(model, max_seq=max_seq, precision=precision, pairs=pairs, check=False, weights=weights,
                   group_size=group_size, ring_len=ring_len)
    dst.parent.mkdir(parents=True, exist_ok=True)
    data = dst.name + ".data"
    (dst.parent / data).unlink(missing_ok=True)
    onnx.save_model(model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data, size_threshold=1024)
    onnx.checker.check_model(str(dst), full_check=False)  # by path: weights past 2 GB stay external
    return report


# --- helpers --------------------------------------------------------------------------------
def _consumed(model: onnx.ModelProto) -> set[str]:
    used = {name for n in model.graph.node for name in n.input}
    return used | {o.name for o in model.graph.output}


def _const_shape(g: onnx.GraphProto, name: str, values: list[int]) -> str:
    if not any(i.name == name for i in g.initializer):
        g.initializer.append(numpy_helper.from_array(np.asarray(values, dtype=np.int64), name))
    return name


def _convert_tensor(t: TensorProto, precision: Precision) -> tuple[TensorProto, int]:
    arr = numpy_helper.to_array(t).astype(np.float32)
    if precision == "fp16":
        clipped = int(np.count_nonzero(np.abs(arr) > FP16_MAX))
        out = numpy_helper.from_array(np.clip(arr, -FP16_MAX, FP16_MAX).astype(np.float16), t.name)
        return out, clipped
    import torch  # bf16 has no numpy dtype; torch rounds to nearest-even like the hardware

    bits = torch.from_numpy(np.ascontiguousarray(arr)).to(torch.bfloat16).view(torch.int16).numpy()
    out = helper.make_tensor(t.name, TensorProto.BFLOAT16, list(arr.shape), bits.tobytes(), raw=True)
    return out, 0
