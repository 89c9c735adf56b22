"""cpu engine lowering: the IR's TensorScatter + Attention per layer -> ONNX Runtime's fused
GroupQueryAttention (com.microsoft), writing the shared past/present buffer in place; each
residual Add + RMSNormalization -> SkipSimplifiedLayerNormalization.

The IR stays standard ONNX; only the cpu engine graph (engine/model.opt.onnx) carries the contrib
op. Semantics are kept exactly: each layer's bool mask (the IR's input, or a sliding-window layer's
band of it) becomes GQA's additive attention_bias (pad slots, window and causality all come from
it), write_index becomes seqlens_k.
"""
from __future__ import annotations

from collections.abc import Mapping

import onnx
from onnx import TensorProto, helper

MASKED = -1e30  # finite: a row that masks everything but itself never meets -inf - -inf


def lower_for_onnxruntime(model: onnx.ModelProto) -> dict[str, int]:
    """Every rewrite of the cpu engine graph, in order; returns what each did (for the manifest)."""
    return {"fused_attention_layers": fuse_group_query_attention(model),
            "fused_skip_norms": fuse_skip_rms_norm(model)}


def _producers(g: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {o: n for n in g.node for o in n.output}


def _consumers(g: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    out: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for i in n.input:
            out.setdefault(i, []).append(n)
    return out


def _attr(n: onnx.NodeProto, name: str) -> object:
    for a in n.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return None


def _unheads(prod: dict[str, onnx.NodeProto], name: str) -> str | None:
    """The (B, S, H*D) tensor behind Transpose(0,2,1,3)(Reshape(x, (B, S, H, D)))."""
    t = prod.get(name)
    if t is None or t.op_type != "Transpose" or list(_attr(t, "perm") or []) != [0, 2, 1, 3]:
        return None
    r = prod.get(t.input[0])
    return r.input[0] if r is not None and r.op_type == "Reshape" else None


def fuse_group_query_attention(model: onnx.ModelProto) -> int:
    """Rewrite every static-style attention block in place; returns how many were fused (0: untouched)."""
    g = model.graph
    prod, cons = _producers(g), _consumers(g)
    plans = []
    for a in g.node:
        if a.op_type != "Attention" or len(a.input) < 4:
            continue
        tk, tv = prod.get(a.input[1]), prod.get(a.input[2])
        if tk is None or tv is None or tk.op_type != "TensorScatter" or tv.op_type != "TensorScatter":
            continue
        q3, k3, v3 = _unheads(prod, a.input[0]), _unheads(prod, tk.input[1]), _unheads(prod, tv.input[1])
        users = cons.get(a.output[0], [])
        if None in (q3, k3, v3) or len(users) != 1 or users[0].op_type != "Transpose":
            return 0
        merge = cons.get(users[0].output[0], [])
        if len(merge) != 1 or merge[0].op_type != "Reshape" or list(_attr(users[0], "perm") or []) != [0, 2, 1, 3]:
            return 0
        outputs = {x.name for x in g.output}
        if any(cons.get(o, []) != [a] or o not in outputs for o in (a.input[1], a.input[2])):
            return 0  # the updated cache must feed only this Attention and be the present output
        plans.append((a, tk, tv, q3, k3, v3, merge[0]))
    if not plans:
        return 0
    write_index = plans[0][1].input[2]
    # shared once for every layer: seqlens_k = write_index + S - 1, total = max + 1
    pre = [
        helper.make_node("Shape", ["input_ids"], ["kvx_gqa/seq"], start=1, end=2),
        helper.make_node("Cast", ["kvx_gqa/seq"], ["kvx_gqa/seq32"], to=TensorProto.INT32),
        helper.make_node("Cast", [write_index], ["kvx_gqa/wi32"], to=TensorProto.INT32),
        helper.make_node("Add", ["kvx_gqa/wi32", "kvx_gqa/seq32"], ["kvx_gqa/held"]),
        helper.make_node("Sub", ["kvx_gqa/held", "kvx_gqa/one"], ["kvx_gqa/seqlens_k"]),
        helper.make_node("ReduceMax", ["kvx_gqa/held"], ["kvx_gqa/total"], keepdims=0),
        helper.make_node("Reshape", ["kvx_gqa/total", "kvx_gqa/shape1"], ["kvx_gqa/total1"]),
        helper.make_node("Cast", ["kvx_gqa/total1"], ["kvx_gqa/total64"], to=TensorProto.INT64),
    ]
    g.initializer.extend([
        helper.make_tensor("kvx_gqa/one", TensorProto.INT32, [], [1]),
        helper.make_tensor("kvx_gqa/shape1", TensorProto.INT64, [1], [1]),
        helper.make_tensor("kvx_gqa/zero", TensorProto.FLOAT, [], [0.0]),
        helper.make_tensor("kvx_gqa/masked", TensorProto.FLOAT, [], [MASKED]),
        helper.make_tensor("kvx_gqa/start", TensorProto.INT64, [1], [0]),
        helper.make_tensor("kvx_gqa/axis3", TensorProto.INT64, [1], [3]),
    ])
    replace: dict[int, list[onnx.NodeProto]] = {}
    dead: set[int] = set()
    biases: dict[str, str] = {}  # bool mask -> its additive bias, made once, before the first layer reading it
    for a, tk, tv, q3, k3, v3, merge in plans:
        scope = a.name.rsplit("/", 1)[0]
        packed = _packed_qkv(prod, cons, q3, k3, v3)
        qkv = [q3, k3, v3] if packed is None else [packed, "", ""]
        made = [] if a.input[3] in biases else _additive_bias(a.input[3], biases)
        gqa = helper.make_node(
            "GroupQueryAttention",
            [*qkv, tk.input[0], tv.input[0], "kvx_gqa/seqlens_k", "kvx_gqa/total", "", "", "", biases[a.input[3]]],
            [merge.output[0], tk.output[0], tv.output[0]],
            name=f"{scope}/GroupQueryAttention_0", domain="com.microsoft",
            num_heads=int(_attr(a, "q_num_heads")), kv_num_heads=int(_attr(a, "kv_num_heads")),
            scale=float(_attr(a, "scale")), softcap=float(_attr(a, "softcap") or 0.0),  # type: ignore[arg-type]
        )
        replace[id(merge)] = [*made, gqa]
        dead.update({id(a), id(tk), id(tv)})
    _splice(model, replace, dead, prepend=pre)
    _drop_dead(g)
    return len(plans)


def _additive_bias(mask: str, biases: dict[str, str]) -> list[onnx.NodeProto]:
    """Where(mask, 0, MASKED) cut to the `total` slots GQA reads: the nodes, and biases[mask] := its name."""
    n = len(biases)
    full, bias = f"kvx_gqa/bias_full_{n}", f"kvx_gqa/bias_{n}"
    biases[mask] = bias
    return [helper.make_node("Where", [mask, "kvx_gqa/zero", "kvx_gqa/masked"], [full]),
            helper.make_node("Slice", [full, "kvx_gqa/start", "kvx_gqa/total64", "kvx_gqa/axis3"], [bias])]


def _packed_qkv(prod: dict[str, onnx.NodeProto], cons: dict[str, list[onnx.NodeProto]], q: str, k: str,
                v: str) -> str | None:
    """The fused projection behind q, k, v when they are a bare Split of it (no RoPE between):
    GroupQueryAttention then reads it packed and the Split goes. Models with RoPE keep the Split and
    their RotaryEmbedding nodes: GroupQueryAttention's own rotation (do_rotary) takes the decode
    position from seqlens_k, i.e. the slot, not position_ids, which is wrong for left-padded rows
    (measured: ONNX Runtime 1.31, tests/test_cpu_fusion.py)."""
    split = prod.get(q)
    if split is None or split.op_type != "Split" or list(split.output) != [q, k, v]:
        return None
    if int(_attr(split, "axis") or 0) not in (-1, 2) or any(len(cons.get(x, [])) != 1 for x in (q, k, v)):
        return None
    return split.input[0]


def fuse_skip_rms_norm(model: onnx.ModelProto) -> int:
    """Residual Add + RMSNormalization -> com.microsoft SkipSimplifiedLayerNormalization, which
    returns both the normalized tensor and the sum the next residual reads: one kernel instead of
    two, twice per layer. Returns how many were fused."""
    g = model.graph
    prod, cons = _producers(g), _consumers(g)
    inits = {t.name for t in g.initializer}
    replace: dict[int, onnx.NodeProto] = {}
    dead: set[int] = set()
    for n in g.node:
        if n.op_type != "RMSNormalization" or n.domain != "" or len(n.input) != 2:
            continue
        add = prod.get(n.input[0])
        if add is None or add.op_type != "Add" or id(add) in replace or any(i in inits for i in add.input):
            continue
        if n.input[1] not in inits:
            continue  # the fused node takes the Add's place, where gamma must already exist
        axis = _attr(n, "axis")
        if (axis if axis is not None else -1) != -1 or _attr(n, "stash_type") not in (None, 1):
            continue
        if any(u.op_type == "RMSNormalization" and u is not n for u in cons.get(add.output[0], [])):
            continue
        eps = _attr(n, "epsilon")
        replace[id(add)] = helper.make_node(
            "SkipSimplifiedLayerNormalization", [add.input[0], add.input[1], n.input[1]],
            [n.output[0], "", "", add.output[0]], name=n.name.replace("RMSNormalization", "SkipSimplifiedLayerNormalization"),
            domain="com.microsoft", epsilon=float(eps if eps is not None else 1e-5))
        dead.add(id(n))
    if replace:
        _splice(model, replace, dead)
    return len(replace)


def _splice(model: onnx.ModelProto, replace: Mapping[int, onnx.NodeProto | list[onnx.NodeProto]], dead: set[int],
            prepend: list[onnx.NodeProto] | None = None) -> None:
    """Put each replacement (a node or several) where its original stood, drop the dead nodes, declare the
    contrib domain."""
    g = model.graph
    nodes: list[onnx.NodeProto] = []
    for n in g.node:
        if id(n) not in dead:
            r = replace.get(id(n), n)
            nodes += r if isinstance(r, list) else [r]
    del g.node[:]
    g.node.extend([*(prepend or []), *nodes])
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))


def _drop_dead(g: onnx.GraphProto) -> None:
    """Remove nodes whose outputs nothing reads (the old head split/merge Transposes and Reshapes)."""
    outputs = {o.name for o in g.output}
    while True:
        used = {i for n in g.node for i in n.input} | outputs
        keep = [n for n in g.node if any(o in used for o in n.output)]
        if len(keep) == len(g.node):
            return
        del g.node[:]
        g.node.extend(keep)
