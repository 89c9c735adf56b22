"""Mixture-of-experts routers kept in fp32 inside the fp16/bf16 graph the nvidia target builds.

A router (the gate Linear, Softmax over the experts, TopK and its renormalisation, the routing matrix
scattered from it) picks experts by comparing probabilities: rounded to fp16 it picks other experts than
the fp32 reference on near ties, and one other expert changes a token's whole MLP output. So its nodes
keep fp32: the router's input is Cast to fp32, its weights stay fp32, and each routing tensor the experts
read is Cast back to the engine's type. TensorRT builds the network strongly typed (trt_build.network_flags),
so these ONNX dtypes are the layers' precisions; trt_build checks the parsed router layers are fp32.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import onnx
from onnx import TensorProto, helper

from kvexport_nvidia.graph import all_nodes, subgraphs

FLOATS = (TensorProto.FLOAT,)
# ops a router's fp32 island may hold: the gate (Gemm, or MatMul + bias Add), the softmax, top-k and its
# renormalisation, and the routing matrix (probs * 0, ScatterElements)
ISLAND_OPS = frozenset({"Gemm", "MatMul", "Add", "Softmax", "TopK", "ReduceSum", "Div", "Mul", "ScatterElements"})
INT_OUTPUTS = {"TopK": {1}}  # (op, output index) pairs that are not float: TopK's indices


@dataclass
class RouterIslands:
    """The nodes, initializers and boundary tensors of every router kept in fp32."""

    nodes: list[str] = field(default_factory=list)  # island node names, in graph order
    initializers: set[str] = field(default_factory=set)  # fp32 weights and constants of the islands
    inputs: list[str] = field(default_factory=list)  # float tensors entering an island (Cast to fp32)
    outputs: list[str] = field(default_factory=list)  # island float tensors read outside (Cast back)

    @property
    def routers(self) -> int:
        return sum(1 for n in self.nodes if "/TopK" in n or n.endswith("TopK"))


def find_routers(model: onnx.ModelProto) -> RouterIslands:
    """The fp32 islands of the graph's routers: from each gate (a Gemm/MatMul with a constant weight whose
    output goes through Softmax into TopK), every node that reads an island tensor and otherwise only
    constants. Nothing is changed here; an initializer an island shares with other nodes is copied."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    consts = set(inits)  # initializers only: a Constant node's value would be converted with the rest
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    islands = RouterIslands()
    members: set[int] = set()  # id() of island nodes
    tensors: set[str] = set()  # every output of an island node
    for gate in g.node:
        if gate.op_type not in ("Gemm", "MatMul") or len(gate.input) < 2 or gate.input[1] not in inits:
            continue
        softmax = [c for c in consumers.get(gate.output[0], []) if c.op_type == "Softmax"]
        if not any(c.op_type == "TopK" for s in softmax for c in consumers.get(s.output[0], [])):
            continue
        frontier = [gate]
        while frontier:
            node = frontier.pop()
            if id(node) in members:
                continue
            members.add(id(node))
            tensors.update(o for o in node.output if o)
            for o in node.output:
                for c in consumers.get(o, []):
                    if c.op_type in ISLAND_OPS and all(not i or i in tensors or i in consts for i in c.input):
                        frontier.append(c)
    if not members:
        return islands
    island_nodes = [n for n in g.node if id(n) in members]
    floats = {o for n in island_nodes for j, o in enumerate(n.output) if o and j not in INT_OUTPUTS.get(n.op_type, ())}
    outside_reads = _reads_outside(g, members)
    for n in island_nodes:
        islands.nodes.append(n.name)
        for j, i in enumerate(n.input):
            if i in consts:
                if i in inits and inits[i].data_type in FLOATS:
                    islands.initializers.add(i)
            elif i and i not in tensors and i not in islands.inputs and not (n.op_type == "TopK" and j == 1):
                islands.inputs.append(i)
    islands.outputs = [t for t in sorted(floats) if t in outside_reads]
    _unshare(model, islands, members)
    return islands


def _reads_outside(g: onnx.GraphProto, members: set[int]) -> set[str]:
    """Tensors read by nodes outside the islands: the main graph's other nodes, every node of an If's
    branches (they read the routing tensors from the outer scope) and the graph outputs."""
    reads = {i for n in g.node if id(n) not in members for i in n.input}
    for sub in subgraphs(g):
        reads |= {i for n in sub.node for i in n.input}
    return reads | {o.name for o in g.output}


def _unshare(model: onnx.ModelProto, islands: RouterIslands, members: set[int]) -> None:
    """An fp32 initializer an island shares with nodes outside it gets its own copy for the island,
    so that convert_precision can make the original fp16 and leave the copy fp32."""
    g = model.graph
    outside = {i for n in all_nodes(g) if id(n) not in members for i in n.input}
    for name in sorted(islands.initializers & outside):
        src = next(i for i in g.initializer if i.name == name)
        copy = onnx.TensorProto()
        copy.CopyFrom(src)
        copy.name = f"{name}/fp32"
        g.initializer.append(copy)
        for n in g.node:
            if id(n) in members:
                for j, i in enumerate(n.input):
                    if i == name:
                        n.input[j] = copy.name
        islands.initializers.discard(name)
        islands.initializers.add(copy.name)


def cast_islands(model: onnx.ModelProto, islands: RouterIslands, target: int) -> int:
    """After convert_precision (which left the islands' initializers fp32): Cast each island input to fp32
    and each island output read outside back to `target`. Returns the Casts inserted."""
    if not islands.nodes:
        return 0
    g = model.graph
    names = set(islands.nodes)
    inside = [n for n in g.node if n.name in names]
    to32 = {t: f"{t}/fp32" for t in islands.inputs}
    back = {t: f"{t}/fp32" for t in islands.outputs}  # the island now writes t/fp32; t is the Cast back
    for n in inside:
        for j, i in enumerate(n.input):
            if i in to32:
                n.input[j] = to32[i]
            elif i in back:
                n.input[j] = back[i]
        for j, o in enumerate(n.output):
            if o in back:
                n.output[j] = back[o]
    casts_in = {name: helper.make_node("Cast", [t], [name], to=TensorProto.FLOAT, name=f"{name}/Cast")
                for t, name in to32.items()}
    casts_out = {name: helper.make_node("Cast", [name], [t], to=target, name=f"{t}/Cast_back")
                 for t, name in back.items()}
    # topological order: an input's Cast right before its first island reader, an output's Cast right after
    # its producer
    new_nodes: list[onnx.NodeProto] = []
    for n in g.node:
        new_nodes += [casts_in.pop(i) for i in n.input if i in casts_in]
        new_nodes.append(n)
        new_nodes += [casts_out[o] for o in n.output if o in casts_out]
    del g.node[:]
    g.node.extend(new_nodes)
    return len(to32) + len(back)
