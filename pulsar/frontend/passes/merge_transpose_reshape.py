"""Collapse chains of layout ops: Transpose pairs, Reshape chains, cancelling Squeeze / Unsqueeze.

Exporters convert between layouts op by op (NCHW <-> NHWC around attention, flatten then reshape),
leaving pairs that compose into one op or into nothing. Each such op is a full copy of a feature
map on the NPU, and a point where the quantizer has to keep the same scale on both sides.

Rules work on a pair (first -> second) where ``second`` reads ``first``'s output:

* Transpose -> Transpose: one Transpose with the composed permutation, or nothing if it is the
  identity (a Transpose followed by its inverse).
* Reshape / Flatten / Squeeze / Unsqueeze -> Reshape: only the last Reshape is needed, since a
  reshape depends on the element order alone, which none of them changes.
* Unsqueeze -> Squeeze and Squeeze -> Unsqueeze of the same axes: nothing.

``first`` stays while something else reads it, so a rewrite never duplicates work.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from pulsar.frontend.graph import (
    DEFAULT_DOMAINS,
    attr,
    consumers,
    dims_of,
    drop_value_info,
    initializers,
    output_names,
    overridable_initializers,
    producers,
    remove_nodes,
    rename_uses,
    tensor_names,
    unique_name,
)
from pulsar.frontend.passes.registry import register_pass
from pulsar.frontend.shapes import inferred_graph

log = logging.getLogger(__name__)


@dataclass
class _Context:
    model: onnx.ModelProto
    inits: dict[str, onnx.TensorProto]
    constant: set[str]
    taken: set[str]
    _dims: dict[str, list[int | str | None]] | None = field(default=None, repr=False)

    def dims(self, name: str) -> list[int | str | None] | None:
        """Inferred dims of ``name`` (computed once, on first use; rewrites keep values unchanged)."""
        if self._dims is None:
            graph = inferred_graph(self.model)
            self._dims = {t.name: list(t.dims) for t in graph.initializer}
            for vi in [*graph.input, *graph.value_info, *graph.output]:
                dims = dims_of(vi)
                if dims is not None:
                    self._dims.setdefault(vi.name, dims)
        return self._dims.get(name)

    def rank(self, name: str) -> int | None:
        dims = self.dims(name)
        return None if dims is None else len(dims)

    def static_shape(self, name: str) -> tuple[int, ...] | None:
        dims = self.dims(name)
        if dims is None or not all(isinstance(d, int) for d in dims):
            return None
        return tuple(dims)  # type: ignore[arg-type]

    def constant_ints(self, name: str) -> list[int] | None:
        if name not in self.constant:
            return None
        return [int(v) for v in numpy_helper.to_array(self.inits[name]).ravel()]


# A rule gets (first, second, context) and returns "bypass" when ``second`` outputs exactly
# ``first``'s input, "rewired" when it rewrote ``second`` to read ``first``'s input, else None.
Rule = Callable[[onnx.NodeProto, onnx.NodeProto, _Context], str | None]
RULES: dict[tuple[str, str], Rule] = {}


def _rule(firsts: tuple[str, ...], second: str) -> Callable[[Rule], Rule]:
    def decorator(fn: Rule) -> Rule:
        for first in firsts:
            RULES[(first, second)] = fn
        return fn

    return decorator


def _perm(node: onnx.NodeProto, rank: int | None) -> list[int] | None:
    perm = attr(node, "perm")
    if perm is not None:
        return list(perm)
    return None if rank is None else list(reversed(range(rank)))  # the default reverses the axes


@_rule(("Transpose",), "Transpose")
def _transposes(first, second, ctx) -> str | None:
    known = attr(first, "perm") or attr(second, "perm")
    rank = len(known) if known is not None else ctx.rank(first.input[0])
    p1, p2 = _perm(first, rank), _perm(second, rank)
    if p1 is None or p2 is None or len(p1) != len(p2):
        return None
    composed = [p1[axis] for axis in p2]  # output axis i of the pair is input axis p1[p2[i]]
    if composed == list(range(len(composed))):
        return "bypass"
    kept = [a for a in second.attribute if a.name != "perm"]
    del second.attribute[:]
    second.attribute.extend([*kept, helper.make_attribute("perm", composed)])
    second.input[0] = first.input[0]
    return "rewired"


@_rule(("Reshape", "Flatten", "Squeeze", "Unsqueeze"), "Reshape")
def _reshapes(first, second, ctx) -> str | None:
    src, dst = first.input[0], second.output[0]
    if len(second.input) < 2:
        return None
    src_shape, dst_shape = ctx.static_shape(src), ctx.static_shape(dst)
    if src_shape is not None and src_shape == dst_shape:
        return "bypass"
    target = ctx.constant_ints(second.input[1])
    if target is None:
        return None
    if 0 in target and not attr(second, "allowzero", 0):
        # A 0 copies a dim of the Reshape's input, which is about to change: spell the dims out.
        if dst_shape is None:
            return None
        name = unique_name(f"{second.name or dst}_shape", ctx.taken)
        ctx.model.graph.initializer.append(numpy_helper.from_array(np.array(dst_shape, np.int64), name))
        second.input[1] = name
    second.input[0] = src
    return "rewired"


_ALL = "all"


def _axes(node: onnx.NodeProto, ctx: _Context) -> list[int] | str | None:
    """Squeeze / Unsqueeze axes (input from opset 13, attribute before); ``_ALL`` when not given
    (Squeeze then drops every size-1 axis); None when they are not constant."""
    if len(node.input) > 1 and node.input[1]:
        return ctx.constant_ints(node.input[1])
    axes = attr(node, "axes")
    return _ALL if axes is None else list(axes)


def _normalized(axes: list[int], rank: int | None) -> set[int] | None:
    if any(a < 0 for a in axes):
        if rank is None:
            return None
        axes = [a + rank for a in axes]
    return set(axes)


@_rule(("Unsqueeze",), "Squeeze")
def _unsqueeze_squeeze(first, second, ctx) -> str | None:
    inserted = _axes(first, ctx)
    removed = _axes(second, ctx)
    if not isinstance(inserted, list) or removed is None:
        return None
    if removed == _ALL:  # Squeeze of every size-1 axis: identity when the input had none
        shape = ctx.static_shape(first.input[0])
        return "bypass" if shape is not None and 1 not in shape else None
    rank = ctx.rank(first.output[0])
    a, b = _normalized(inserted, rank), _normalized(removed, rank)
    return "bypass" if a is not None and a == b else None


@_rule(("Squeeze",), "Unsqueeze")
def _squeeze_unsqueeze(first, second, ctx) -> str | None:
    removed = _axes(first, ctx)
    inserted = _axes(second, ctx)
    rank = ctx.rank(first.input[0])  # Squeeze input and Unsqueeze output have the same rank
    if not isinstance(inserted, list) or removed is None:
        return None
    if removed == _ALL:
        shape = ctx.static_shape(first.input[0])
        if shape is None:
            return None
        removed = [axis for axis, d in enumerate(shape) if d == 1]
    a, b = _normalized(removed, rank), _normalized(inserted, rank)
    return "bypass" if a is not None and a == b else None


def _bypass(graph: onnx.GraphProto, second: onnx.NodeProto, src: str, outputs: set[str]) -> bool:
    """Make readers of ``second``'s output read ``src``; True if ``second`` can go."""
    dst = second.output[0]
    if dst in outputs:
        # The output name is the model's interface: keep it through an Identity, which
        # remove_identity then hands to ``src``'s producer where it can.
        second.CopyFrom(helper.make_node("Identity", [src], [dst], name=second.name))
        return False
    rename_uses(graph, dst, src)
    return True


@register_pass("merge_transpose_reshape")
def merge_transpose_reshape(model: onnx.ModelProto) -> bool:
    graph = model.graph
    inits = initializers(graph)
    ctx = _Context(model, inits, set(inits) - overridable_initializers(model), tensor_names(graph))
    made = producers(graph)
    outputs = output_names(graph)
    removed, firsts, touched = [], [], []
    for second in graph.node:
        if second.domain not in DEFAULT_DOMAINS or not second.input:
            continue
        first = made.get(second.input[0])
        if first is None or first.domain not in DEFAULT_DOMAINS or not first.input:
            continue
        rule = RULES.get((first.op_type, second.op_type))
        result = rule(first, second, ctx) if rule is not None else None
        if result is None:
            continue
        touched.append(second.output[0])
        firsts.append(first)
        if result == "bypass" and _bypass(graph, second, first.input[0], outputs):
            removed.append(second)
    if not touched:
        return False
    readers = consumers(graph)
    dead = {id(n) for n in removed}
    for first in firsts:  # drop the first op of a pair once nothing reads it any more
        if id(first) in dead or first.output[0] in outputs:
            continue
        if all(id(r) in dead for r in readers.get(first.output[0], [])):
            removed.append(first)
            dead.add(id(first))
            touched.append(first.output[0])
    drop_value_info(graph, touched)
    remove_nodes(graph, removed)
    log.debug("merged %d layout-op pairs", len(firsts))
    return True
