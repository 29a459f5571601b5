"""What every fusion pass needs: constants, types, privacy checks and an atomic rewrite.

A fusion may only remove tensors nobody else reads, so each matcher asks :meth:`FusionContext.private`
about every intermediate; matches are collected first and applied in one sweep (:meth:`apply`) so
that the producer / consumer maps stay valid while matching.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from pulsar.frontend.graph import (
    DEFAULT_DOMAINS,
    all_node_names,
    attr,
    consumers,
    dims_of,
    drop_value_info,
    initializers,
    output_names,
    overridable_initializers,
    producers,
    tensor_names,
    unique_name,
)
from pulsar.frontend.passes.constant_to_initializer import constant_tensor
from pulsar.frontend.shapes import inferred_graph

log = logging.getLogger(__name__)

# Exporters write sqrt(2), 1/sqrt(2), sqrt(2/pi), 0.044715 ... with 4 to 8 digits.
CONST_RTOL = 1e-3
# Constants that scale the result itself (0.5, 1/6, clip bounds, 1 and -1) are written exactly by
# every exporter; a 1e-3 slack there would be a 1e-3 output error, above the pass check's 1e-4.
SCALE_RTOL = 1e-5
MS_DOMAIN = "com.microsoft"
FLOAT = onnx.TensorProto.FLOAT


def close(value: float | None, target: float, rtol: float = CONST_RTOL) -> bool:
    return value is not None and math.isclose(value, target, rel_tol=rtol, abs_tol=rtol * 1e-3)


@dataclass
class Fusion:
    """Replace ``remove`` by ``add``; the new nodes take the place of ``at`` (the pattern's last node)."""

    remove: list[onnx.NodeProto]
    add: list[onnx.NodeProto]
    at: onnx.NodeProto
    initializers: dict[str, np.ndarray]


class FusionContext:
    """Read-only views of one graph plus the fusions found so far."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.graph = graph = model.graph
        self.made = producers(graph)
        self.readers = consumers(graph)
        self.outputs = output_names(graph)
        overridable = overridable_initializers(model)
        self.inits = {k: v for k, v in initializers(graph).items() if k not in overridable}
        self.elem_type: dict[str, int] = {}
        self.dims: dict[str, list[int | str | None]] = {}
        inferred = inferred_graph(model)  # the large weights as inputs: the loop below reads them from graph
        for vi in [*inferred.input, *inferred.value_info, *inferred.output]:
            if vi.type.HasField("tensor_type"):
                if vi.type.tensor_type.elem_type:
                    self.elem_type[vi.name] = vi.type.tensor_type.elem_type
                dims = dims_of(vi)
                if dims is not None:
                    self.dims[vi.name] = dims
        for t in graph.initializer:
            self.elem_type[t.name] = t.data_type
            self.dims[t.name] = list(t.dims)
        self.fusions: list[Fusion] = []
        self._claimed: set[int] = set()
        self._node_names = {n for n in all_node_names(graph) if n}
        self._tensor_names = tensor_names(graph)
        self._value_info: dict[str, onnx.TypeProto] = {}

    # --- questions ------------------------------------------------------------------------------

    def const(self, name: str) -> np.ndarray | None:
        """Value of a constant tensor (initializer or Constant node); None if it can change at run time."""
        if name in self.inits:
            return numpy_helper.to_array(self.inits[name])
        node = self.made.get(name)
        if node is not None and node.op_type == "Constant" and node.domain in DEFAULT_DOMAINS:
            tensor = constant_tensor(node)
            return None if tensor is None else numpy_helper.to_array(tensor)
        return None

    def scalar(self, name: str) -> float | None:
        """A constant holding one real number (any rank, size 1)."""
        value = self.const(name) if name else None
        if value is None or value.size != 1 or not np.issubdtype(value.dtype, np.number):
            return None
        return float(value.ravel()[0])

    def node(self, name: str, *op_types: str) -> onnx.NodeProto | None:
        """The default-domain producer of ``name`` if its op type is one of ``op_types``."""
        node = self.made.get(name)
        if node is None or node.domain not in DEFAULT_DOMAINS or node.op_type not in op_types:
            return None
        return node

    def private(self, name: str) -> bool:
        """Read by exactly one node and not a graph output: a fusion may consume it."""
        return name not in self.outputs and len(self.readers.get(name, [])) == 1

    def only_read_by(self, name: str, nodes: list[onnx.NodeProto]) -> bool:
        ids = {id(n) for n in nodes}
        readers = self.readers.get(name, [])
        return name not in self.outputs and bool(readers) and all(id(r) in ids for r in readers)

    def sole_reader(self, name: str, *op_types: str) -> onnx.NodeProto | None:
        """The only (default-domain, ``op_types``) reader of a private tensor."""
        if not self.private(name):
            return None
        node = self.readers[name][0]
        if node.domain not in DEFAULT_DOMAINS or (op_types and node.op_type not in op_types):
            return None
        return node

    def rank(self, name: str) -> int | None:
        dims = self.dims.get(name)
        return None if dims is None else len(dims)

    def is_float32(self, name: str) -> bool:
        """Fused kernels are float32 in onnxruntime's CPU provider; other types keep their chain."""
        return self.elem_type.get(name) == FLOAT

    def reduce_axes(self, node: onnx.NodeProto) -> tuple[list[int] | None, bool] | None:
        """(axes, keepdims) of a Reduce* node, axes None for "all"; None if not constant or a no-op."""
        axes = attr(node, "axes")
        if axes is None and len(node.input) > 1 and node.input[1]:
            value = self.const(node.input[1])
            if value is None:
                return None
            axes = value.ravel().tolist()
        if not axes:
            if attr(node, "noop_with_empty_axes", 0):
                return None
            axes = None
        return (None if axes is None else [int(a) for a in axes]), bool(attr(node, "keepdims", 1))

    # --- building -------------------------------------------------------------------------------

    def claim(self, nodes: list[onnx.NodeProto]) -> bool:
        """Reserve nodes for one fusion; False if another fusion already took any of them."""
        ids = {id(n) for n in nodes}
        if ids & self._claimed:
            return False
        self._claimed |= ids
        return True

    def node_name(self, nodes: list[onnx.NodeProto], op_type: str) -> str:
        """Name a fused node after its pattern: ``/blk/ln/ReduceMean`` ... -> ``/blk/ln/LayerNormalization``."""
        names = [n.name for n in nodes if n.name]
        prefix = os.path.commonprefix(names) if names else ""
        prefix = prefix[: prefix.rfind("/") + 1] if "/" in prefix else ""
        base = f"{prefix}{op_type}" if prefix else f"{op_type}_{names[-1] if names else 'fused'}"
        return unique_name(base, self._node_names)

    def tensor_name(self, base: str) -> str:
        return unique_name(base, self._tensor_names)

    def annotate_like(self, name: str, like: str) -> None:
        """Give ``name`` the type and shape of ``like``: onnx shape inference skips contrib ops."""
        elem = self.elem_type.get(like)
        if elem is None:
            return
        dims = self.dims.get(like)
        vi = helper.make_tensor_value_info(name, elem, dims)
        self._value_info[name] = vi.type

    def fuse(
        self,
        remove: list[onnx.NodeProto],
        add: list[onnx.NodeProto],
        initializers: dict[str, np.ndarray] | None = None,
    ) -> bool:
        """Record a fusion; the new nodes (and initializers, by names from :meth:`tensor_name`)
        replace ``remove`` at the position of its last node in graph order."""
        unique = list({id(n): n for n in remove}.values())
        if not self.claim(unique):
            return False
        order = {id(n): i for i, n in enumerate(self.graph.node)}
        last = max(unique, key=lambda n: order[id(n)])
        self.fusions.append(Fusion(unique, add, last, dict(initializers or {})))
        return True

    def apply(self) -> bool:
        """Rewrite the graph with every recorded fusion; True if there was any."""
        if not self.fusions:
            return False
        graph = self.graph
        at = {id(f.at): f.add for f in self.fusions}
        dead = {id(n) for f in self.fusions for n in f.remove}
        kept: list[onnx.NodeProto] = []
        for node in graph.node:
            kept.extend(at.get(id(node), []))
            if id(node) not in dead:
                kept.append(node)
        produced = {o for f in self.fusions for n in f.add for o in n.output}
        gone = {o for f in self.fusions for n in f.remove for o in n.output}
        del graph.node[:]  # the kept references stay valid; extend() copies them back in
        graph.node.extend(kept)
        for fusion in self.fusions:
            for name, value in fusion.initializers.items():
                graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
        drop_value_info(graph, (gone - produced) | set(self._value_info))
        for name, ttype in self._value_info.items():
            vi = graph.value_info.add()
            vi.name = name
            vi.type.CopyFrom(ttype)
        return True


def opset(model: onnx.ModelProto) -> int:
    """The default-domain opset: the fused ops exist only from some version on."""
    return next((int(op.version) for op in model.opset_import if op.domain in DEFAULT_DOMAINS), 1)


def ensure_opset(model: onnx.ModelProto, domain: str, version: int) -> None:
    """Import ``domain`` so that its ops are valid in the model."""
    if not any(op.domain == domain for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid(domain, version))


def binary_const(ctx: FusionContext, node: onnx.NodeProto) -> tuple[str, float, int] | None:
    """(variable input, scalar constant, index of the constant) of a two-input node, else None."""
    if len(node.input) != 2:
        return None
    for index in (1, 0):
        value = ctx.scalar(node.input[index])
        if value is not None and ctx.scalar(node.input[1 - index]) is None:
            return node.input[1 - index], value, index
    return None


def run_fusion(
    model: onnx.ModelProto,
    anchors: Collection[str],
    match: Callable[[FusionContext, onnx.NodeProto], bool],
    what: str,
) -> bool:
    """Try ``match`` on every default-domain node of an ``anchors`` type, then rewrite at once.

    Shape inference (in :class:`FusionContext`) is the costly part, so graphs without an anchor
    skip it.
    """
    nodes = [n for n in model.graph.node if n.op_type in anchors and n.domain in DEFAULT_DOMAINS]
    if not nodes:
        return False
    ctx = FusionContext(model)
    count = sum(match(ctx, node) for node in nodes)
    if count:
        log.debug("fused %d %s patterns", count, what)
    return ctx.apply()
