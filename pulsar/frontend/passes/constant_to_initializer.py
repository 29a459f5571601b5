"""Constant nodes -> initializers.

Exporters (Paddle especially) emit hundreds of Constant nodes; as initializers they are visible to
constant folding, BN folding and the quantizer, which all look for weights among initializers.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from pulsar.frontend.graph import DEFAULT_DOMAINS, drop_value_info, output_names, remove_nodes
from pulsar.frontend.passes.registry import register_pass


def _sparse_to_dense(sparse: onnx.SparseTensorProto) -> np.ndarray:
    values = numpy_helper.to_array(sparse.values)
    indices = numpy_helper.to_array(sparse.indices).astype(np.int64)
    dims = tuple(sparse.dims)
    dense = np.zeros(int(np.prod(dims)) if dims else 1, dtype=values.dtype)
    flat = indices.ravel() if indices.ndim == 1 else np.ravel_multi_index(tuple(indices.T), dims)
    dense[flat] = values
    return dense.reshape(dims)


def _strings(values: list[bytes]) -> np.ndarray:
    return np.array([v.decode("utf-8") for v in values], dtype=object)


# Attribute name -> how to turn its value into the initializer's array (``value`` is handled apart).
_VALUE_KINDS: dict[str, Callable[[object], np.ndarray]] = {
    "value_float": lambda v: np.array(v, dtype=np.float32),
    "value_floats": lambda v: np.array(list(v), dtype=np.float32),
    "value_int": lambda v: np.array(v, dtype=np.int64),
    "value_ints": lambda v: np.array(list(v), dtype=np.int64),
    "value_string": lambda v: np.array(v.decode("utf-8"), dtype=object),
    "value_strings": lambda v: _strings(list(v)),
    "sparse_value": _sparse_to_dense,
}


def constant_tensor(node: onnx.NodeProto) -> onnx.TensorProto | None:
    """The tensor a Constant node produces, named after its output; None for unknown attributes."""
    if len(node.attribute) != 1:
        return None
    attr = node.attribute[0]
    if attr.name == "value":
        tensor = onnx.TensorProto()
        tensor.CopyFrom(attr.t)
    elif attr.name in _VALUE_KINDS:
        tensor = numpy_helper.from_array(_VALUE_KINDS[attr.name](helper.get_attribute_value(attr)))
    else:
        return None
    tensor.name = node.output[0]
    return tensor


@register_pass("constant_to_initializer")
def constant_to_initializer(model: onnx.ModelProto) -> bool:
    graph = model.graph
    outputs = output_names(graph)
    done = []
    for node in graph.node:
        if node.op_type != "Constant" or node.domain not in DEFAULT_DOMAINS or node.output[0] in outputs:
            continue  # a graph output must stay produced by a node
        tensor = constant_tensor(node)
        if tensor is None:
            continue
        graph.initializer.append(tensor)
        done.append(node)
    drop_value_info(graph, (n.output[0] for n in done))
    return remove_nodes(graph, done) > 0
