"""Small ONNX graph walkers the nvidia lowering passes share."""
from __future__ import annotations

from collections.abc import Callable, Iterator

import onnx
from onnx import helper


def attr(node: onnx.NodeProto, name: str, default: object) -> object:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def subgraphs(g: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """Every graph nested in g's nodes' attributes (an If's then/else branches), depth first."""
    for n in g.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield a.g
                yield from subgraphs(a.g)


def all_nodes(g: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    yield from g.node
    for sub in subgraphs(g):
        yield from sub.node


def rewrite_nodes(model: onnx.ModelProto,
                   rewrite: Callable[[onnx.GraphProto, onnx.NodeProto, int], list[onnx.NodeProto] | None]) -> int:
    """Each node for which rewrite(graph, node, rewritten so far) returns nodes is replaced by them, in place;
    returns how many were replaced."""
    g = model.graph
    new_nodes: list[onnx.NodeProto] = []
    count = 0
    for node in g.node:
        out = rewrite(g, node, count)
        new_nodes += [node] if out is None else out
        count += out is not None
    del g.node[:]
    g.node.extend(new_nodes)
    return count
