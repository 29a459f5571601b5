"""Remove nodes that return their input unchanged.

Identity, inference-mode Dropout, Cast to the tensor's own type and shape ops whose output shape
equals the input shape all cost a requantization boundary or a CPU round trip later for nothing.
Graph output names are part of the model's interface, so when the removed node produced one, the
upstream producer is renamed to it instead.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import numpy_helper

from pulsar.frontend.graph import (
    DEFAULT_DOMAINS,
    TypeInfo,
    attr,
    consumers,
    drop_value_info,
    graph_input_names,
    initializers,
    output_names,
    producers,
    remove_nodes,
    rename_uses,
)
from pulsar.frontend.passes.registry import register_pass

Predicate = Callable[[onnx.NodeProto, TypeInfo, dict[str, onnx.TensorProto], dict], bool]

# op_type -> "is this node a no-op?"; every rule sees the node, the inferred types/shapes,
# the initializers and the consumer map.
NO_OP_RULES: dict[str, Predicate] = {}


def _rule(*op_types: str) -> Callable[[Predicate], Predicate]:
    def decorator(fn: Predicate) -> Predicate:
        for op in op_types:
            NO_OP_RULES[op] = fn
        return fn

    return decorator


def _same_static_shape(node: onnx.NodeProto, info: TypeInfo) -> bool:
    src, dst = info.shape.get(node.input[0]), info.shape.get(node.output[0])
    return src is not None and src == dst


@_rule("Identity")
def _identity(node, info, inits, readers) -> bool:
    return True


@_rule("Dropout")
def _dropout(node, info, inits, readers) -> bool:
    if len(node.output) > 1 and node.output[1] and readers.get(node.output[1]):
        return False  # the mask is used
    if len(node.input) > 2 and node.input[2]:
        training = inits.get(node.input[2])
        return training is not None and not bool(numpy_helper.to_array(training))
    return True


@_rule("Cast")
def _cast(node, info, inits, readers) -> bool:
    return info.elem_type.get(node.input[0]) == attr(node, "to")


@_rule("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Expand")
def _reshape(node, info, inits, readers) -> bool:
    return _same_static_shape(node, info)


@_rule("Transpose")
def _transpose(node, info, inits, readers) -> bool:
    perm = attr(node, "perm")
    if perm is None:  # default perm reverses the axes: a no-op for rank <= 1 only
        shape = info.shape.get(node.input[0])
        return shape is not None and len(shape) <= 1
    return list(perm) == list(range(len(perm)))


@_rule("Pad")
def _pad(node, info, inits, readers) -> bool:
    pads = inits.get(node.input[1]) if len(node.input) > 1 else None
    return pads is not None and not np.any(numpy_helper.to_array(pads)) and _same_static_shape(node, info)


@register_pass("remove_identity")
def remove_identity(model: onnx.ModelProto) -> bool:
    graph = model.graph
    info = TypeInfo.infer(model)
    inits = initializers(graph)
    readers = consumers(graph)
    made = producers(graph)
    outputs = output_names(graph)
    fixed_names = set(graph_input_names(graph)) | set(inits)
    removed: list[onnx.NodeProto] = []
    touched: set[str] = set()
    for node in list(graph.node):
        rule = NO_OP_RULES.get(node.op_type)
        if rule is None or node.domain not in DEFAULT_DOMAINS or not node.input or not node.input[0]:
            continue
        src, dst = node.input[0], node.output[0]
        # Earlier removals may have renamed ``src``; the new name has the same type and shape, so
        # ``info`` (keyed by the old names) still answers correctly and chains go in one sweep.
        if not rule(node, info, inits, readers):
            continue
        if dst not in outputs:
            rename_uses(graph, dst, src)
        elif src in fixed_names or src in outputs or src not in made:
            continue  # cannot rename a graph input / initializer / other output: keep the node
        else:
            # The producer of ``src`` now writes ``dst`` directly, so the output name survives.
            producer = made[src]
            for i, name in enumerate(producer.output):
                if name == src:
                    producer.output[i] = dst
            rename_uses(graph, src, dst)
            made[dst] = producer
        touched.update((src, dst))
        removed.append(node)
    drop_value_info(graph, touched)
    return remove_nodes(graph, removed) > 0
