"""cpu engine lowering: the IR's TensorScatter + Attention per layer -> ONNX Runtime's fused
GroupQueryAttention (com.microsoft), writing the shared past/present buffer in place; each
residual Add + RMSNormalization -> SkipSimplifiedLayerNormalization; each routed mixture-of-experts
layer (router, TopK, the If between MoeMlp's gathered and dense forms) -> com.microsoft MoE.

The IR stays standard ONNX; only the cpu engine graph (engine/model.opt.onnx) carries the contrib
op. Semantics are kept exactly: each layer's bool mask (the IR's input, or a sliding-window layer's
band of it) becomes GQA's additive attention_bias (pad slots, window and causality all come from
it), write_index becomes seqlens_k.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kvexport.config import DecoderConfig

MASKED = -1e30  # finite: a row that masks everything but itself never meets -inf - -inf


def lower_for_onnxruntime(model: onnx.ModelProto, config: DecoderConfig | None = None) -> dict[str, int]:
    """Every rewrite of the cpu engine graph, in order; returns what each did (for the manifest).

    A mixture-of-experts config with silu experts and renormalised top-k weights (mixtral; qwen3_moe with
    norm_topk_prob) also runs its routed layers in ONNX Runtime's MoE kernel. Without renormalisation the
    kernel alone matches MoeMlp, but inside the whole decoder graph ONNX Runtime 1.31.1 returned other
    numbers (tiny qwen3_moe: max |dlogit| 0.9 against the IR; exposing the kernel's input or output as a
    graph output made it exact again), so those layers keep the IR's forms."""
    done = {"fused_attention_layers": fuse_group_query_attention(model),
            "fused_skip_norms": fuse_skip_rms_norm(model)}
    if config is not None and config.num_experts:
        lowerable = config.activation == "silu" and config.norm_topk_prob
        done["fused_moe_layers"] = fuse_moe(model, config.num_experts_per_tok, True) if lowerable else 0
    return done


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
    their RotaryEmbedding nodes here; fold_rotary then hands the rotation to the kernel."""
    split = prod.get(q)
    if split is None or split.op_type != "Split" or list(split.output) != [q, k, v]:
        return None
    if int(_attr(split, "axis") or 0) not in (-1, 2) or any(len(cons.get(x, [])) != 1 for x in (q, k, v)):
        return None
    return split.input[0]


def fold_rotary(model: onnx.ModelProto) -> int:
    """Give each fused layer's RoPE to GroupQueryAttention (`do_rotary`) where its q and k are a Split of the
    packed projection followed by one RotaryEmbedding each: the Split and both RotaryEmbedding nodes go, the
    kernel reads the packed q|k|v. Returns how many layers were folded (0: untouched).

    The kernel takes positions from its position_ids input, per row and token, in every call but a first
    prompt (no past), where it takes every row's positions as position_ids[0, 0] + i (measured, ONNX Runtime
    1.31.1). So the positions it is given are each row's last position counted back (a left-padded row's
    real tokens then sit at their own positions, its pad slots below zero), offset by the table's length,
    and the cos/sin tables are preceded by as many rows of an identity rotation (cos 1, sin 0): a pad slot
    stays finite and masked. Rows whose starts differ in one first prompt still disagree with that rule:
    the session runs such a call one row at a time (CpuSession.step). Keys enter the cache rotated by
    their positions, exactly as the IR's. Within a row the runtime's positions are consecutive (a prompt, a
    chunk, one token), which the count back assumes."""
    g = model.graph
    prod, cons = _producers(g), _consumers(g)
    inits = {t.name: t for t in g.initializer}
    plans = []
    for n in g.node:
        if n.op_type != "GroupQueryAttention" or n.domain != "com.microsoft" or not n.input[1]:
            continue
        rq, rk, split = prod.get(n.input[0]), prod.get(n.input[1]), prod.get(n.input[2])
        if rq is None or rk is None or split is None or split.op_type != "Split":
            continue
        if any(r.op_type != "RotaryEmbedding" or r.domain != "" or len(r.input) != 4 for r in (rq, rk)):
            continue
        if list(split.output) != [rq.input[0], rk.input[0], n.input[2]] or int(_attr(split, "axis") or 0) not in (-1, 2):
            continue
        if any(len(cons.get(x, [])) != 1 for x in split.output) or any(len(cons.get(r.output[0], [])) != 1 for r in (rq, rk)):
            continue
        if list(rq.input[1:]) != list(rk.input[1:]) or rq.input[3] != "position_ids" or rq.input[1] not in inits:
            continue
        if any(int(_attr(r, "interleaved") or 0) or int(_attr(r, "rotary_embedding_dim") or 0) for r in (rq, rk)):
            continue  # rotate-half over the whole head only: the kernel's interleaved and partial forms are untested here
        if int(inits[rq.input[1]].dims[1]) % 8:
            continue  # the kernel asks for a table width that is a multiple of 8 (head_dim a multiple of 16)
        plans.append((n, rq, rk, split))
    if not plans:
        return 0
    pre = [helper.make_node("Shape", ["input_ids"], ["kvx_rope/seq"], start=1, end=2),
           helper.make_node("Sub", ["kvx_rope/seq", "kvx_rope/one"], ["kvx_rope/back"]),
           helper.make_node("Slice", ["position_ids", "kvx_rope/minus1", "kvx_rope/end", "kvx_rope/axis1"], ["kvx_rope/last"]),
           helper.make_node("Sub", ["kvx_rope/last", "kvx_rope/back"], ["kvx_rope/first"]),  # (B, 1)
           helper.make_node("Squeeze", ["kvx_rope/seq"], ["kvx_rope/seq0"]),
           helper.make_node("Range", ["kvx_rope/zero", "kvx_rope/seq0", "kvx_rope/step"], ["kvx_rope/range"]),
           helper.make_node("Add", ["kvx_rope/first", "kvx_rope/range"], ["kvx_rope/from0"])]  # (B, S)
    g.initializer.extend([helper.make_tensor("kvx_rope/one", TensorProto.INT64, [1], [1]),
                          helper.make_tensor("kvx_rope/minus1", TensorProto.INT64, [1], [-1]),
                          helper.make_tensor("kvx_rope/end", TensorProto.INT64, [1], [2**62]),
                          helper.make_tensor("kvx_rope/axis1", TensorProto.INT64, [1], [1]),
                          helper.make_tensor("kvx_rope/zero", TensorProto.INT64, [], [0]),
                          helper.make_tensor("kvx_rope/step", TensorProto.INT64, [], [1])])
    tables: dict[tuple[str, str], tuple[str, str, str]] = {}  # (cos, sin) -> (shifted cos, shifted sin, positions)
    replace: dict[int, list[onnx.NodeProto]] = {}
    dead: set[int] = set()
    for n, rq, rk, split in plans:
        key = (rq.input[1], rq.input[2])
        if key not in tables:
            rows, half = (int(d) for d in inits[key[0]].dims)
            t = f"kvx_rope/t{len(tables)}"
            g.initializer.extend([numpy_helper.from_array(np.ones((rows, half), np.float32), f"{t}/pad_cos"),
                                  numpy_helper.from_array(np.zeros((rows, half), np.float32), f"{t}/pad_sin"),
                                  helper.make_tensor(f"{t}/offset", TensorProto.INT64, [], [rows])])
            pre += [helper.make_node("Concat", [f"{t}/pad_cos", key[0]], [f"{t}/cos"], axis=0),
                    helper.make_node("Concat", [f"{t}/pad_sin", key[1]], [f"{t}/sin"], axis=0),
                    helper.make_node("Add", ["kvx_rope/from0", f"{t}/offset"], [f"{t}/positions"])]
            tables[key] = (f"{t}/cos", f"{t}/sin", f"{t}/positions")
        cos, sin, positions = tables[key]
        ins = list(n.input) + [""] * (11 - len(n.input))
        ins[0:3], ins[7:10] = [split.input[0], "", ""], [cos, sin, positions]
        gqa = helper.make_node("GroupQueryAttention", ins, list(n.output), name=n.name, domain="com.microsoft")
        gqa.attribute.extend(a for a in n.attribute if a.name not in ("do_rotary", "rotary_interleaved"))
        gqa.attribute.extend([helper.make_attribute("do_rotary", 1), helper.make_attribute("rotary_interleaved", 0)])
        replace[id(n)] = [gqa]
        dead.update({id(rq), id(rk), id(split)})
    _splice(model, replace, dead, prepend=pre)
    _drop_dead(g)
    return len(plans)


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
    """Remove nodes whose outputs nothing reads (the old head split/merge Transposes and Reshapes); what an
    If's branches read from this graph counts as read."""
    outputs = {o.name for o in g.output}
    while True:
        used = {i for n in g.node for i in n.input} | outputs
        used |= {r for n in g.node for a in n.attribute if a.type == onnx.AttributeProto.GRAPH for r in _outer_refs(a.g)}
        keep = [n for n in g.node if any(o in used for o in n.output)]
        if len(keep) == len(g.node):
            return
        del g.node[:]
        g.node.extend(keep)


# --- mixture of experts -> com.microsoft MoE -------------------------------------------------
def moe_relayout(prefix: str, gate_up: str, down: str, num_experts: int, hidden: int,
                 width: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto], str, str]:
    """Nodes that turn MoeMlp's (E, h, 2I) gate|up and (E, I, h) down into the MoE kernel's fc1 (E, 2I, h),
    each gate row followed by its up row (swiglu_fusion=1: interleaved), and fc2 (E, h, I). Every input is
    an initializer, so the session's constant folding does it once, at build time."""
    E, h, I = num_experts, hidden, width
    shapes = {"split": [E, h, 2, I], "fc1": [E, 2 * I, h]}
    inits = [helper.make_tensor(f"{prefix}/{k}_shape", TensorProto.INT64, [len(v)], v) for k, v in shapes.items()]
    fc1, fc2 = f"{prefix}/fc1", f"{prefix}/fc2"
    nodes = [
        helper.make_node("Reshape", [gate_up, f"{prefix}/split_shape"], [f"{prefix}/gate_up4"]),  # (E, h, 2, I)
        helper.make_node("Transpose", [f"{prefix}/gate_up4"], [f"{prefix}/gate_up_t"], perm=[0, 3, 2, 1]),  # (E, I, 2, h)
        helper.make_node("Reshape", [f"{prefix}/gate_up_t", f"{prefix}/fc1_shape"], [fc1]),  # (E, 2I, h)
        helper.make_node("Transpose", [down], [fc2], perm=[0, 2, 1]),  # (E, h, I)
    ]
    return nodes, inits, fc1, fc2


def moe_node(x: str, logits: str, fc1: str, fc2: str, y: str, *, top_k: int, renormalise: bool,
             name: str) -> onnx.NodeProto:
    """ONNX Runtime's fused MoE over router logits (T, E): softmax, top k (renormalised where asked),
    silu(x @ gate) * (x @ up) @ down per chosen expert, weighted sum; alpha 1, beta 0 and no clamp make its
    SwiGLU plain silu gating."""
    return helper.make_node("MoE", [x, logits, fc1, "", fc2], [y], name=name, domain="com.microsoft", k=top_k,
                            activation_type="swiglu", swiglu_fusion=1, normalize_routing_weights=int(renormalise),
                            activation_alpha=1.0, activation_beta=0.0, swiglu_limit=float("inf"))


def moe_op_model(router_t: np.ndarray, gate_up: np.ndarray, down: np.ndarray, *, top_k: int,
                 renormalise: bool) -> onnx.ModelProto:
    """One routed layer as a model x (B, S, h) -> y through the MoE kernel: the router's (h, E) MatMul, then
    MoE (benchmarks/moe_layer.py times it beside the plain-ONNX forms)."""
    E, h, I = gate_up.shape[0], gate_up.shape[1], gate_up.shape[2] // 2
    relayout, inits, fc1, fc2 = moe_relayout("moe", "gate_up", "down", E, h, I)
    nodes = [helper.make_node("MatMul", ["x", "router"], ["logits3"]),
             helper.make_node("Reshape", ["logits3", "moe/logits_shape"], ["logits"]),
             *relayout, moe_node("x", "logits", fc1, fc2, "y", top_k=top_k, renormalise=renormalise, name="moe")]
    inits += [helper.make_tensor("moe/logits_shape", TensorProto.INT64, [2], [-1, E]),
              numpy_helper.from_array(np.ascontiguousarray(router_t, np.float32), "router"),
              numpy_helper.from_array(np.ascontiguousarray(gate_up, np.float32), "gate_up"),
              numpy_helper.from_array(np.ascontiguousarray(down, np.float32), "down")]
    graph = helper.make_graph(nodes, "moe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", h])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", h])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=10)


def _outer_refs(g: onnx.GraphProto) -> set[str]:
    """Names a subgraph reads from its enclosing scopes (nested subgraphs included)."""
    made = {o for n in g.node for o in n.output} | {t.name for t in g.initializer} | {i.name for i in g.input}
    refs = {i for n in g.node for i in n.input if i}
    for n in g.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                refs |= _outer_refs(a.g)
    return refs - made


def fuse_moe(model: onnx.ModelProto, top_k: int, renormalise: bool) -> int:
    """Each routed layer of the IR (router -> Softmax -> TopK, then the If that picks MoeMlp's gathered
    or dense form) -> one com.microsoft MoE node on the router's logits, with its weights laid out for the
    kernel. Returns how many layers were fused; a graph without the pattern is left as it is."""
    g = model.graph
    prod = _producers(g)
    inits = {t.name: t for t in g.initializer}
    ifs = [n for n in g.node if n.op_type == "If"]
    refs = {id(n): _outer_refs(n.attribute[0].g) | _outer_refs(n.attribute[1].g) for n in ifs}
    replace: dict[int, onnx.NodeProto] = {}
    extra_nodes: list[onnx.NodeProto] = []
    for topk in (n for n in g.node if n.op_type == "TopK"):
        soft = prod.get(topk.input[0])
        src = prod.get(soft.input[0]) if soft is not None and soft.op_type == "Softmax" else None
        if src is not None and src.op_type == "Cast":
            src = prod.get(src.input[0])
        # the router: x (T, h) @ (h, E), or as the exporter writes a 2-D Linear, Gemm(x, (E, h), transB=1)
        gemm = src is not None and src.op_type == "Gemm" and len(src.input) == 2 and _attr(src, "transB") == 1 \
            and _attr(src, "transA") in (None, 0) and _attr(src, "alpha") in (None, 1.0)
        if src is None or not (gemm or src.op_type == "MatMul") or src.input[1] not in inits:
            continue
        E = int(inits[src.input[1]].dims[0 if gemm else 1])
        # the If reading this TopK's chosen experts, and the two 3-D expert tensors its branches read
        owner = next((n for n in ifs if topk.output[1] in refs[id(n)] or topk.output[0] in refs[id(n)]), None)
        if owner is None or id(owner) in replace:
            continue
        experts = [inits[r] for r in sorted(refs[id(owner)]) if r in inits and len(inits[r].dims) == 3
                   and int(inits[r].dims[0]) == E]
        gate_up = next((t for t in experts if int(t.dims[2]) % 2 == 0 and any(
            int(d.dims[1]) * 2 == int(t.dims[2]) and int(d.dims[2]) == int(t.dims[1]) for d in experts)), None)
        down = next((d for d in experts if gate_up is not None and int(d.dims[1]) * 2 == int(gate_up.dims[2])
                     and int(d.dims[2]) == int(gate_up.dims[1])), None)
        if gate_up is None or down is None:
            continue
        scope = owner.name.rsplit("/", 1)[0] if "/" in owner.name else f"moe{len(replace)}"
        nodes, shapes, fc1, fc2 = moe_relayout(f"{scope}/moe", gate_up.name, down.name, E,
                                               int(gate_up.dims[1]), int(down.dims[1]))
        g.initializer.extend(shapes)
        extra_nodes += nodes
        replace[id(owner)] = moe_node(src.input[0], src.output[0], fc1, fc2, owner.output[0], top_k=top_k,
                                      renormalise=renormalise, name=f"{scope}/MoE_0")
    if not replace:
        return 0
    _splice(model, replace, set(), prepend=extra_nodes)
    _drop_dead(g)
    return len(replace)
