"""``If`` with a constant condition -> the nodes of the branch it takes.

Control flow that is static once the inputs are known: a model that picks its 8 kHz or 16 kHz
network by a sample-rate input (frozen with ``const_processors``), or by an input's shape (fixed by
``input_shapes``, folded to a constant by ``fold_constants``). Inlined, the branch's ops are ordinary
nodes of the main graph: the quantizer sees them, shape inference gives an LSTM inside the branch
its shapes, and the NPU can run them. Branch-local names are unique across scopes (the ONNX rule),
so the nodes move as they are; each branch output reaches the If's output through an Identity that
``remove_identity`` removes.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import helper

from pulsar.frontend.graph import DEFAULT_DOMAINS, all_node_names, tensor_names, unique_name
from pulsar.frontend.passes.constant_to_initializer import constant_tensor
from pulsar.frontend.passes.registry import register_pass

log = logging.getLogger(__name__)


def _condition(graph: onnx.GraphProto, name: str) -> bool | None:
    """The value of a one-element boolean (or numeric) constant, None when it is not constant."""
    for t in graph.initializer:
        if t.name == name:
            value = onnx.numpy_helper.to_array(t)
            break
    else:
        node = next((n for n in graph.node if name in n.output), None)
        tensor = constant_tensor(node) if node is not None and node.op_type == "Constant" else None
        if tensor is None:
            return None
        value = onnx.numpy_helper.to_array(tensor)
    return bool(np.asarray(value).reshape(-1)[0]) if np.asarray(value).size == 1 else None


def _inline(graph: onnx.GraphProto, node: onnx.NodeProto, branch: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The branch's nodes (its initializers as main-graph initializers) and Identities to the If's outputs."""
    taken = set(all_node_names(graph))
    names = tensor_names(graph)
    out: list[onnx.NodeProto] = []
    for t in branch.initializer:
        graph.initializer.append(t)
    for n in branch.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(n)
        if copy.name:
            copy.name = unique_name(copy.name, taken)
            taken.add(copy.name)
        out.append(copy)
    for src, dst in zip(branch.output, node.output, strict=True):
        if dst:
            out.append(helper.make_node("Identity", [src.name], [dst],
                                        name=unique_name(f"{node.name or 'If'}/{dst}", taken)))
    known = {vi.name for vi in graph.value_info}
    graph.value_info.extend(vi for vi in branch.value_info if vi.name not in known and vi.name not in names)
    return out


@register_pass("fold_if")
def fold_if(model: onnx.ModelProto) -> bool:
    graph = model.graph
    changed = False
    kept: list[onnx.NodeProto] = []
    for node in list(graph.node):
        cond = _condition(graph, node.input[0]) if node.op_type == "If" and node.domain in DEFAULT_DOMAINS \
            and node.input else None
        if cond is None:
            kept.append(node)
            continue
        branch = next(a.g for a in node.attribute if a.name == ("then_branch" if cond else "else_branch"))
        if len(branch.output) != len(node.output):
            kept.append(node)
            continue
        log.info("If %s: condition is constant (%s), inlined its %s branch (%d nodes)", node.name or node.output[0],
                 cond, "then" if cond else "else", len(branch.node))
        kept.extend(_inline(graph, node, branch))
        changed = True
    if changed:
        del graph.node[:]
        graph.node.extend(kept)
    return changed
