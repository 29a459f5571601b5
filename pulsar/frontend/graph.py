"""Small helpers over ``onnx.GraphProto`` shared by the loader and the passes.

The passes edit protos in place; these helpers answer the questions every pass asks (who produces
or consumes a tensor, which tensors are constant, what shape inference knows) so that each pass
module stays about its own rewrite.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator

import numpy as np
import onnx
from onnx import numpy_helper

from pulsar.core.graph import outer_scope_inputs, subgraphs

DEFAULT_DOMAINS = ("", "ai.onnx")


def node_inputs(node: onnx.NodeProto) -> list[str]:
    """Explicit inputs plus names its subgraphs capture from the enclosing scope."""
    names = [n for n in node.input if n]
    for sub in subgraphs(node):
        names.extend(sorted(outer_scope_inputs(sub)))
    return names


def producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {out: node for node in graph.node for out in node.output if out}


def consumers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    """Tensor name -> nodes reading it (a node reading a tensor twice is listed once)."""
    result: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in graph.node:
        for name in dict.fromkeys(node_inputs(node)):
            result[name].append(node)
    return result


def initializers(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in graph.initializer}


def overridable_initializers(model: onnx.ModelProto) -> set[str]:
    """Initializers that are also graph inputs: from IR 4 on they are defaults a caller may feed."""
    if model.ir_version < 4:
        return set()
    inits = {t.name for t in model.graph.initializer}
    return {i.name for i in model.graph.input if i.name in inits}


def graph_input_names(graph: onnx.GraphProto) -> list[str]:
    """Real inputs: old IR versions also list initializers as graph inputs."""
    inits = {t.name for t in graph.initializer}
    return [i.name for i in graph.input if i.name not in inits]


def output_names(graph: onnx.GraphProto) -> set[str]:
    return {o.name for o in graph.output}


def all_node_names(graph: onnx.GraphProto) -> Iterator[str]:
    for node in graph.node:
        yield node.name
        for sub in subgraphs(node):
            yield from all_node_names(sub)


def unique_name(base: str, taken: set[str]) -> str:
    """``base`` if free, else ``base_1``, ``base_2`` ...; the result is added to ``taken``."""
    name, k = base, 0
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    taken.add(name)
    return name


def tensor_names(graph: onnx.GraphProto) -> set[str]:
    """Every tensor name defined in the graph (inputs, initializers, node outputs)."""
    names = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    for node in graph.node:
        names.update(o for o in node.output if o)
    return names


def rename_uses(graph: onnx.GraphProto, old: str, new: str) -> None:
    """Make every reader of ``old`` read ``new`` instead, subgraph captures included."""
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new
        for sub in subgraphs(node):
            if old in outer_scope_inputs(sub):
                rename_uses(sub, old, new)
                for out in sub.output:
                    if out.name == old:
                        out.name = new


def drop_value_info(graph: onnx.GraphProto, names: Iterable[str]) -> None:
    """Forget stale shape annotations for tensors that changed or disappeared."""
    names = set(names)
    kept = [vi for vi in graph.value_info if vi.name not in names]
    if len(kept) != len(graph.value_info):
        del graph.value_info[:]
        graph.value_info.extend(kept)


def remove_nodes(graph: onnx.GraphProto, dead: Iterable[onnx.NodeProto]) -> int:
    """Remove nodes by identity, keeping the order of the others; returns how many went."""
    dead_ids = {id(n) for n in dead}
    if not dead_ids:
        return 0
    kept = [n for n in graph.node if id(n) not in dead_ids]
    removed = len(graph.node) - len(kept)
    del graph.node[:]  # the kept references stay valid; extend() copies them back in
    graph.node.extend(kept)
    return removed


def attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def to_array(tensor: onnx.TensorProto) -> np.ndarray:
    return numpy_helper.to_array(tensor)


def add_initializer(graph: onnx.GraphProto, name: str, value: np.ndarray) -> onnx.TensorProto:
    tensor = numpy_helper.from_array(np.asarray(value), name)
    graph.initializer.append(tensor)
    return graph.initializer[-1]


def dims_of(value_info: onnx.ValueInfoProto) -> list[int | str | None] | None:
    """Dims of a tensor value_info: int when fixed, the symbol (or None) when not; None if no rank."""
    ttype = value_info.type.tensor_type
    if not value_info.type.HasField("tensor_type") or not ttype.HasField("shape"):
        return None
    dims: list[int | str | None] = []
    for d in ttype.shape.dim:
        if d.HasField("dim_value") and d.dim_value > 0:
            dims.append(int(d.dim_value))
        elif d.HasField("dim_value") and d.dim_value == 0:
            dims.append(0)
        else:
            dims.append(d.dim_param or None)
    return dims


class TypeInfo:
    """Element types and static shapes shape inference could establish, by tensor name."""

    def __init__(self, model: onnx.ModelProto | onnx.GraphProto) -> None:
        self.elem_type: dict[str, int] = {}
        self.shape: dict[str, tuple[int, ...]] = {}
        graph = model.graph if isinstance(model, onnx.ModelProto) else model
        for vi in [*graph.input, *graph.value_info, *graph.output]:
            if not vi.type.HasField("tensor_type"):
                continue
            if vi.type.tensor_type.elem_type:
                self.elem_type[vi.name] = vi.type.tensor_type.elem_type
            dims = dims_of(vi)
            if dims is not None and all(isinstance(d, int) for d in dims):
                self.shape[vi.name] = tuple(dims)  # type: ignore[arg-type]
        for t in graph.initializer:
            self.elem_type[t.name] = t.data_type
            self.shape[t.name] = tuple(t.dims)

    @classmethod
    def infer(cls, model: onnx.ModelProto) -> TypeInfo:
        from pulsar.frontend.shapes import inferred_graph

        return cls(inferred_graph(model))  # read only: the large weights need not come back
