"""Load a float ONNX model and bring it to the form the later stages expect.

Later stages assume one opset (so op semantics are known), named nodes (users address layers by
name in the config) and a model the ONNX checker accepts; this module guarantees all three or
explains on one line why it cannot.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from onnx import version_converter

from pulsar.core.graph import subgraphs
from pulsar.errors import PulsarError
from pulsar.frontend.graph import DEFAULT_DOMAINS, all_node_names, unique_name
from pulsar.frontend.shapes import (  # noqa: F401  (re-exported: the loader is the frontend's entry point)
    apply_input_shapes,
    infer_shapes,
    parse_input_shapes,
    require_static_inputs,
)

log = logging.getLogger(__name__)

TARGET_OPSET = 17


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def default_opset(model: onnx.ModelProto) -> int | None:
    for op in model.opset_import:
        if op.domain in DEFAULT_DOMAINS:
            return int(op.version)
    return None


def load_model(path: str | Path) -> onnx.ModelProto:
    """Read, check, convert to ``TARGET_OPSET`` and name the nodes of the model at ``path``."""
    path = Path(path)
    if not path.exists():
        raise PulsarError(f"model file {path} does not exist; check the `input` path in the config")
    if not path.is_file():
        raise PulsarError(f"model path {path} is not a file; point `input` at the .onnx file itself")
    if path.stat().st_size == 0:
        raise PulsarError(f"model file {path} is empty; re-export the model or copy it again")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except OSError as exc:
        raise PulsarError(
            f"model file {path} cannot be read ({_first_line(exc)}); check its permissions"
        ) from exc
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise PulsarError(
            f"model file {path} is not a valid ONNX model (it could not be decoded: {_first_line(exc)}); "
            "the file may be truncated or in another format, re-export it to ONNX"
        ) from exc
    if not model.HasField("graph") or (not model.graph.node and not model.graph.output):
        raise PulsarError(f"model file {path} holds no ONNX graph; re-export it to ONNX")
    try:
        onnx.load_external_data_for_model(model, str(path.parent))
    except (OSError, ValueError, onnx.checker.ValidationError) as exc:
        raise PulsarError(
            f"model file {path} refers to external weight data that cannot be read ({_first_line(exc)}); "
            "keep the weight files next to the model as they were exported"
        ) from exc
    try:
        # Checking by path handles external data and models above the 2 GB protobuf limit.
        onnx.checker.check_model(str(path))
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise PulsarError(
            f"model file {path} fails the ONNX checker: {_first_line(exc)}; fix the export or re-export it"
        ) from exc
    model = convert_opset(model, path)
    name_nodes(model.graph)
    return model


def convert_opset(model: onnx.ModelProto, path: str | Path = "model") -> onnx.ModelProto:
    """Convert a default-domain opset below ``TARGET_OPSET`` up to it; newer opsets are kept."""
    version = default_opset(model)
    if version is None or version >= TARGET_OPSET:
        return model
    try:
        converted = version_converter.convert_version(model, TARGET_OPSET)
    except Exception as exc:  # the converter raises bare RuntimeErrors for ops it cannot adapt
        raise PulsarError(
            f"model file {path}: converting opset {version} to {TARGET_OPSET} failed "
            f"({_first_line(exc)}); re-export the model with opset_version={TARGET_OPSET}"
        ) from exc
    log.info("converted %s from opset %d to %d", Path(path).name, version, TARGET_OPSET)
    return converted


def _walk(graph: onnx.GraphProto) -> Iterator[tuple[int, onnx.NodeProto]]:
    for index, node in enumerate(graph.node):
        yield index, node
        for sub in subgraphs(node):
            yield from _walk(sub)


def name_nodes(graph: onnx.GraphProto) -> int:
    """Give unnamed nodes (and repeats of a used name) unique names; returns how many changed."""
    taken = {n for n in all_node_names(graph) if n}
    seen: set[str] = set()
    renamed = 0
    for index, node in _walk(graph):
        if node.name and node.name not in seen:
            seen.add(node.name)
            continue
        old = node.name
        node.name = unique_name(old or f"{node.op_type}_{index}", taken)
        seen.add(node.name)
        if old:
            log.info('node name "%s" is used twice; the repeat is renamed "%s"', old, node.name)
        renamed += 1
    return renamed
