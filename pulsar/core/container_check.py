"""Structural checks of a loaded compiled model, each failure one line naming the file and the entry.

The checksum (:mod:`pulsar.core.integrity`) catches damage; these checks catch a file that is
intact but not what pulsar writes (edited by hand or by another tool, or from a pulsar that wrote
something this one does not know), before a run would trip over it with a ``KeyError``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import numpy as np
import onnx
from onnx import helper

from pulsar.core.container_schema import metadata_problem, option_problem
from pulsar.errors import PulsarError

_FIX = "the file is corrupt or was edited: rebuild it"


def _fail(path: Path, what: str) -> PulsarError:
    return PulsarError(f"compiled model {path}: {what}; {_FIX}")


def check_io_types(path: Path, graph: onnx.GraphProto) -> None:
    """Every model input / output is a tensor of a known element type."""
    for kind, values in (("input", graph.input), ("output", graph.output)):
        for v in values:
            if not v.type.HasField("tensor_type") or not v.type.tensor_type.elem_type:
                raise _fail(path, f"model {kind} {v.name!r} has no tensor type")
            try:
                np.dtype(helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type))
            except (KeyError, TypeError, ValueError):
                raise _fail(path, f"model {kind} {v.name!r} has unknown element type "
                                  f"{v.type.tensor_type.elem_type}") from None


def check_dataflow(path: Path, graph: onnx.GraphProto) -> None:
    """Every subgraph reads model inputs or earlier subgraphs' outputs; every model output is made."""
    available = {v.name for v in graph.input}
    for node in graph.node:
        for name in node.input:
            if name not in available:
                raise _fail(path, f"subgraph {node.name!r} reads {name!r}, which no model input or earlier "
                                  "subgraph provides")
        available.update(o for o in node.output if o)
    for v in graph.output:
        if v.name not in available:
            raise _fail(path, f"model output {v.name!r} is not computed by any subgraph")


def string_attr(path: Path, node: onnx.NodeProto, attr: onnx.AttributeProto | None) -> str | None:
    """A string attribute of a subgraph node as text (None when absent)."""
    if attr is None:
        return None
    if attr.type != onnx.AttributeProto.STRING:
        raise _fail(path, f"subgraph {node.name!r} attribute {attr.name!r} is not a string")
    try:
        return attr.s.decode("utf-8")
    except UnicodeDecodeError:
        raise _fail(path, f"subgraph {node.name!r} attribute {attr.name!r} is not UTF-8 text") from None


def parse_options(path: Path, subgraph: str, text: str | None) -> dict[str, object]:
    """A subgraph's ``options``: a JSON mapping of known compiler options with values of their types."""
    if text is None:
        return {}
    try:
        options = json.loads(text)
    except ValueError as exc:
        raise _fail(path, f"subgraph {subgraph!r} options are not valid JSON ({exc})") from None
    problem = option_problem(options)
    if problem:
        raise _fail(path, f"subgraph {subgraph!r} {problem}")
    return cast("dict[str, object]", options)  # option_problem: a mapping of known option keys


def check_metadata(path: Path, meta: dict[str, object], io: dict[str, list[dict[str, object]]]) -> None:
    """Entries pulsar writes have their types; ``inputs`` / ``outputs`` agree with the graph's (``io``)."""
    problem = metadata_problem(meta)
    if problem:
        raise _fail(path, f"metadata {problem}")
    for key, actual in io.items():
        if key in meta and meta[key] != actual:
            listed = cast("list[dict[str, object]]", meta[key])  # metadata_problem checked the type
            names = [t.get("name") for t in listed]
            raise _fail(path, f"metadata pulsar.{key} (tensors {names}) does not describe the model's {key} "
                              f"{[t['name'] for t in actual]} (names, dtypes and shapes must agree)")
