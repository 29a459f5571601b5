"""Helpers shared by the const and op patches."""

from __future__ import annotations

from collections.abc import Iterator

import onnx

from pulsar.core.graph import subgraphs


def all_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """The graph and every If / Loop / Scan body below it."""
    yield graph
    for node in graph.node:
        for sub in subgraphs(node):
            yield from all_graphs(sub)

