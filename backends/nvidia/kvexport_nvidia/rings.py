"""Ring caches of sliding-window layers in the graph TensorRT builds.

TensorRT's KV-cache update layer (IKVCacheUpdateLayer, what its parser makes of TensorScatter) documents the
kLINEAR mode only (TensorRT 10.15 to 11), and a ring's write wraps around its slots. The documented layer that
writes rows at computed positions is IScatterLayer (the parser's ONNX ScatterElements, ELEMENT mode): a ring
layer's circular TensorScatter becomes ScatterElements on axis 2 at rows (write_index + arange(S)) mod R, R the
ring's pinned slot count. IScatterLayer's output is a new tensor (it copies its data input, then writes the
updates), not an alias of the cache input: a ring's present is bound to a second buffer and the runtime swaps
the two every step, so a step copies each ring once (bounded by the window, where the full-length cache it
replaces reads max_seq slots in attention). Global layers keep TensorScatter linear: the in-place update layer.
The ring layers' attention is the IR's own: Attention over the ring then the new rows, under
`sliding_attention_mask`.
"""
from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from kvexport.runtime.ring import RING_DIM
from kvexport_nvidia.graph import attr, rewrite_nodes


def is_circular(node: onnx.NodeProto) -> bool:
    return node.op_type == "TensorScatter" and attr(node, "mode", b"linear") in (b"circular", "circular")


def pin_ring_len(model: onnx.ModelProto, ring_len: int) -> None:
    """ring_len -> the ring's slots on every graph input/output (TensorRT's caches are static)."""
    for vi in [*model.graph.input, *model.graph.output]:
        for d in vi.type.tensor_type.shape.dim:
            if d.dim_param == RING_DIM:
                d.Clear()
                d.dim_value = ring_len


def circular_to_scatter(model: onnx.ModelProto, ring_len: int) -> int:
    """Each circular TensorScatter -> ScatterElements at rows (write_index + arange(S)) mod ring_len.
    Returns how many were rewritten."""
    g = model.graph
    consts = {
        "kvx_ring_zero": helper.make_tensor("kvx_ring_zero", TensorProto.INT64, [], [0]),
        "kvx_ring_one": helper.make_tensor("kvx_ring_one", TensorProto.INT64, [], [1]),
        "kvx_ring_len": helper.make_tensor("kvx_ring_len", TensorProto.INT64, [], [ring_len]),
        "kvx_ring_axis0": helper.make_tensor("kvx_ring_axis0", TensorProto.INT64, [1], [0]),
        "kvx_ring_axis1": helper.make_tensor("kvx_ring_axis1", TensorProto.INT64, [1], [1]),
        "kvx_ring_axes13": helper.make_tensor("kvx_ring_axes13", TensorProto.INT64, [2], [1, 3]),
    }
    have = {i.name for i in g.initializer}
    g.initializer.extend(t for name, t in consts.items() if name not in have)

    def rewrite(_g: onnx.GraphProto, node: onnx.NodeProto, count: int) -> list[onnx.NodeProto] | None:
        if not is_circular(node):
            return None
        cache, update, write = node.input[:3]
        n = node.name or f"TensorScatter_{count}"
        t = {s: f"{n}/{s}" for s in ("S1", "S", "steps", "w", "s", "rows", "mod", "idx4", "shape", "idx")}
        return [
            helper.make_node("Shape", [update], [t["S1"]], start=2, end=3, name=f"{n}/Shape_S"),  # (1,) = S
            helper.make_node("Squeeze", [t["S1"], "kvx_ring_axis0"], [t["S"]], name=f"{n}/Squeeze_S"),
            helper.make_node("Range", ["kvx_ring_zero", t["S"], "kvx_ring_one"], [t["steps"]], name=f"{n}/Range"),  # (S,)
            helper.make_node("Unsqueeze", [write, "kvx_ring_axis1"], [t["w"]], name=f"{n}/Unsqueeze_w"),  # (B, 1)
            helper.make_node("Unsqueeze", [t["steps"], "kvx_ring_axis0"], [t["s"]], name=f"{n}/Unsqueeze_s"),  # (1, S)
            helper.make_node("Add", [t["w"], t["s"]], [t["rows"]], name=f"{n}/Add_rows"),  # (B, S) absolute slots
            helper.make_node("Mod", [t["rows"], "kvx_ring_len"], [t["mod"]], name=f"{n}/Mod"),  # (B, S) ring slots
            helper.make_node("Unsqueeze", [t["mod"], "kvx_ring_axes13"], [t["idx4"]], name=f"{n}/Unsqueeze_idx"),  # (B, 1, S, 1)
            helper.make_node("Shape", [update], [t["shape"]], name=f"{n}/Shape_update"),
            helper.make_node("Expand", [t["idx4"], t["shape"]], [t["idx"]], name=f"{n}/Expand_idx"),  # (B, H_kv, S, D)
            helper.make_node("ScatterElements", [cache, t["idx"], update], list(node.output), axis=2,
                             name=f"{n}/ScatterElements"),  # (B, H_kv, R, D): a new tensor, not the cache's alias
        ]

    return rewrite_nodes(model, rewrite)


def ring_outputs(model: onnx.ModelProto) -> list[str]:
    """The graph outputs a ring's ScatterElements writes (present tensors not aliased to their past)."""
    outs = {o.name for o in model.graph.output}
    return [n.output[0] for n in model.graph.node
            if n.op_type == "ScatterElements" and n.name.endswith("/ScatterElements") and n.output[0] in outs]
