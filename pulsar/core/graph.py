"""Scoping of nested ONNX graphs: which graphs a node holds, which names a graph reads from outside.

Shared by the frontend passes and the compiled-model container (whose bodies refer to weights
stored once at the top level).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import onnx


def subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    """Graphs held in a node's attributes (If / Loop / Scan bodies)."""
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def outer_scope_inputs(graph: onnx.GraphProto) -> set[str]:
    """Names a (sub)graph reads without defining them: outer-scope references."""
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    used: set[str] = set()
    for node in graph.node:
        used.update(n for n in node.input if n)
        for sub in subgraphs(node):
            used |= outer_scope_inputs(sub)
        defined.update(node.output)
    used.update(o.name for o in graph.output)
    return used - defined


def assign_fields(dst: Any, src: Any, skip: str) -> None:
    """Every field of ``dst`` but ``skip`` replaced by ``src``'s (the same message type): a model or
    graph around one big field (the initializers) without copying that field."""
    for fd in dst.DESCRIPTOR.fields:
        if fd.name != skip:
            dst.ClearField(fd.name)
    for fd, value in src.ListFields():
        if fd.name == skip:
            continue
        if hasattr(value, "extend"):  # a repeated field
            getattr(dst, fd.name).extend(value)
        elif fd.message_type is not None:
            getattr(dst, fd.name).CopyFrom(value)
        else:
            setattr(dst, fd.name, value)
