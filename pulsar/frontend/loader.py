"""Load a float ONNX model and bring it to the form the later stages expect.

Later stages assume one opset (so op semantics are known), named nodes (users address layers by
name in the config) and a model the ONNX checker accepts; this module guarantees all three or
explains on one line why it cannot.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import helper, numpy_helper, version_converter

from pulsar.core.graph import subgraphs
from pulsar.core.ort_weights import LIFT_BYTES, raw_size
from pulsar.errors import PulsarError
from pulsar.frontend.graph import (
    DEFAULT_DOMAINS,
    add_initializer,
    all_node_names,
    dims_of,
    tensor_names,
    unique_name,
)
from pulsar.frontend.interface import check_tensor_interface
from pulsar.frontend.ort_opset import max_qdq_opset
from pulsar.frontend.shapes import (  # noqa: F401  (re-exported: the loader is the frontend's entry point)
    apply_input_shapes,
    assign_fields,
    infer_shapes,
    large_weights,
    lift_weights,
    parse_input_shapes,
    require_static_inputs,
    serialized_over,
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


CONFIG_INPUT = "`input` in the config"  # where a build's model path comes from unless the caller says


def is_quant_output(path: str | Path) -> bool:
    """``path`` is a build's output dir or quant dir (the input of model_type QuantModel, not a model)."""
    path = Path(path)
    return path.is_dir() and any((path / d / "quantized.onnx").is_file() for d in ("quant", "."))


def check_model_path(path: str | Path, source: str = CONFIG_INPUT) -> Path:
    """The model path exists and is a non-empty file; ``source`` names where the path came from
    (``--input`` or the config's ``input``), so the message points at what to fix."""
    path = Path(path)
    if not path.exists():
        raise PulsarError(f"model file {path} does not exist; check {source}")
    if is_quant_output(path):
        raise PulsarError(f"model path {path} is a pulsar build's output; to compile its quantized model again "
                          "without calibration set model_type QuantModel (--model_type QuantModel)")
    if not path.is_file():
        raise PulsarError(f"model path {path} is not a file; point {source} at the .onnx file itself")
    if path.stat().st_size == 0:
        raise PulsarError(f"model file {path} is empty; re-export the model or copy it again")
    return path


def load_model(path: str | Path, *, source: str = CONFIG_INPUT) -> onnx.ModelProto:
    """Read, check, convert to ``TARGET_OPSET`` and name the nodes of the model at ``path`` (which
    came from ``source``: see :func:`check_model_path`)."""
    path = check_model_path(path, source)
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
        check_model_light(model, path)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise PulsarError(
            f"model file {path} fails the ONNX checker: {_first_line(exc)}; fix the export or re-export it"
        ) from exc
    check_tensor_interface(model, str(path))  # before conversion: the converter may retype sequences
    check_feedable_inputs(model, str(path))
    model = convert_opset(model, path)
    name_nodes(model.graph)
    return model


_TYPED_FIELDS = ("float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data")


def check_model_light(model: onnx.ModelProto, path: str | Path) -> None:
    """``onnx.checker.check_model`` on the loaded ``model`` (the file at ``path``), without handing it
    the large weights: the checker copies a model it gets in memory and parses one it gets by path
    (0.11-0.14 s for MiniLM's 90 MB, against 0.04 s here). Every raw initializer over 64 KiB is held
    here to what the checker asks of a tensor's value (one value field, raw bytes enough for its type
    and shape: reading their length copies them once) and goes to the checker as a graph input of its
    type and shape; everything else is the checker's. A graph still over 2 GB is checked by path."""
    g = model.graph
    inputs = {i.name for i in g.input}
    seen = Counter(t.name for t in g.initializer)
    big: set[str] = set()
    for t in g.initializer if model.ir_version >= 4 else ():  # before IR 4 an initializer must be an input
        need = raw_size(t)  # 0 unless raw data of a fixed-size numeric type
        if (need < LIFT_BYTES or not t.name or seen[t.name] > 1 or t.name in inputs
                or t.data_location == onnx.TensorProto.EXTERNAL or any(d < 0 for d in t.dims)
                or any(len(getattr(t, f)) for f in _TYPED_FIELDS)):
            continue  # the checker's to judge, names and value fields included
        have = len(t.raw_data)
        if have < need:  # the checker's own rule, in its words
            raise onnx.checker.ValidationError(
                f"TensorProto (tensor name: {t.name}) raw_data size ({have} bytes) is too small for the "
                f"declared shape and type ({need} bytes required)")
        big.add(t.name)
    light = lift_weights(model, big) if big else model
    if serialized_over(light, onnx.checker.MAXIMUM_PROTOBUF - 1):
        onnx.checker.check_model(str(path))  # by path: external data and models over the protobuf limit
    else:
        onnx.checker.check_model(light)


def _element_type(elem_type: int) -> str:
    try:
        return str(onnx.TensorProto.DataType.Name(elem_type)).lower()
    except ValueError:
        return f"type {elem_type}"


def check_feedable_inputs(model: onnx.ModelProto, path: str = "model") -> None:
    """Every graph input is a tensor of a type pulsar can feed (calibration data, sample files,
    ``pulsar run`` inputs are numpy arrays of bool, integers or floats): a string (text) or other
    non-numeric input is named now, not later as a calibration dtype mismatch."""
    inits = {t.name for t in model.graph.initializer}
    for vi in model.graph.input:
        if vi.name in inits or not vi.type.HasField("tensor_type"):
            continue
        elem = vi.type.tensor_type.elem_type
        try:
            kind = np.dtype(helper.tensor_dtype_to_np_dtype(elem)).kind if elem else ""
        except (KeyError, TypeError, ValueError):
            kind = ""
        if kind in ("b", "i", "u", "f"):
            continue
        fix = ("do the text processing before the model and feed numbers (e.g. token ids as int64)"
               if elem == onnx.TensorProto.STRING else
               "re-export the model with a float32 / integer input and convert inside the model (Cast)")
        raise PulsarError(f"{path}: input '{vi.name}' is tensor({_element_type(elem)}); pulsar feeds numeric "
                          f"tensors only (bool, integer, float16/32/64): {fix}")


def convert_opset(model: onnx.ModelProto, path: str | Path = "model") -> onnx.ModelProto:
    """Convert a default-domain opset below ``TARGET_OPSET`` up to it, and one above the highest
    opset onnxruntime runs Q/DQ at (:func:`max_qdq_opset`) down to that; others are kept.

    The converted model keeps the original's interface (graph input / output names, element types
    and shapes), so the user's data still fits; see :func:`keep_interface`.
    """
    version = default_opset(model)
    if version is None:
        return model
    if version < TARGET_OPSET:
        converted = _convert(model, path, version, TARGET_OPSET)
        log.info("converted %s from opset %d to %d", Path(path).name, version, TARGET_OPSET)
        return converted
    limit = max_qdq_opset()
    if limit is None or limit < TARGET_OPSET or version <= limit:
        return model  # nothing gained below TARGET_OPSET: later stages assume at least that
    try:
        converted = _convert(model, path, version, limit)
    except PulsarError as exc:
        # Kept rather than refused: a model that needs an op of its own opset (BitShift on int32,
        # Mod with fmod=0 on floats, SpaceToDepth in CRD mode ...) still builds and runs where no
        # Q/DQ lands on the CPU; only a quantized CPU subgraph would fail to load.
        log.warning("%s. The model is kept at opset %d, above %d, the highest opset the installed "
                    "onnxruntime runs QuantizeLinear / DequantizeLinear at: a build that puts quantized "
                    "operators on the CPU will not load", exc, version, limit)
        return model
    log.info("converted %s from opset %d down to %d, the highest opset the installed onnxruntime "
             "runs QuantizeLinear / DequantizeLinear at", Path(path).name, version, limit)
    return converted


def _convert(model: onnx.ModelProto, path: str | Path, version: int, target: int) -> onnx.ModelProto:
    """``model`` at opset ``target`` with its own interface, checked; a PulsarError names the fix."""
    # the converter and the checker serialize the whole model: its large weights go in as graph
    # inputs (they only need their type and shape) and come back as initializers after
    big = large_weights(model)
    light = lift_weights(model, big) if big else model
    try:
        converted = version_converter.convert_version(light, target)
    except Exception as exc:  # the converter raises bare RuntimeErrors for ops it cannot adapt
        raise PulsarError(
            f"model file {path}: converting opset {version} to {target} failed "
            f"({_first_line(exc)}); re-export the model with opset_version={target}"
        ) from exc
    keep_interface(light, converted, path, version, target)  # the lifted weights: inputs of unchanged types
    _check_converted(light, converted, path, version, target)
    if big:  # the converted model around the original's large weights (one C++ copy of them)
        res = onnx.ModelProto()
        res.CopyFrom(model)
        assign_fields(res, converted, skip="graph")
        assign_fields(res.graph, converted.graph, skip="initializer")
        kept = [i for i in converted.graph.input if i.name not in big]
        del res.graph.input[:]
        res.graph.input.extend(kept)
        mine = {t.name: t for t in converted.graph.initializer}
        inits = res.graph.initializer
        for i in reversed(range(len(inits))):  # the small ones as converted, where they were
            name = inits[i].name
            if name in mine:
                inits[i].CopyFrom(mine.pop(name))
            elif name not in big:
                del inits[i]  # dropped by the converter
        inits.extend(mine.values())  # new ones (attributes turned into inputs) last
        converted = res
    return converted


def _check_converted(original: onnx.ModelProto, model: onnx.ModelProto, path: str | Path,
                     version: int, target: int) -> None:
    """The converter can leave a model the checker refuses (it relabels shapes it does not change:
    an opset-8 Scan fed by another node); refuse it here rather than build a wrong model. The
    converted model is held to the full check (with shape inference) when the original passes it,
    else to the plain one."""
    if serialized_over(model, onnx.checker.MAXIMUM_PROTOBUF - 1):  # ByteSize() >= the maximum
        return  # too large to check in memory; load_model checked the original by path
    errors = (onnx.checker.ValidationError, onnx.shape_inference.InferenceError)
    try:
        onnx.checker.check_model(model, full_check=True)
        return
    except errors as exc:
        failure: Exception = exc
    try:
        onnx.checker.check_model(original, full_check=True)
    except errors:
        try:
            onnx.checker.check_model(model)
            return
        except errors as exc:
            failure = exc
    raise PulsarError(
        f"model file {path}: converting opset {version} to {target} gives a model that fails the ONNX "
        f"checker ({_first_line(failure)}); re-export the model with opset_version={target}"
    ) from failure


def _shape_text(dims: list[int | str | None] | None) -> str:
    return "unknown" if dims is None else "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


def _all_tensor_names(graph: onnx.GraphProto) -> set[str]:
    names = tensor_names(graph) | {o.name for o in graph.output} | {v.name for v in graph.value_info}
    for node in graph.node:
        for sub in subgraphs(node):
            names |= _all_tensor_names(sub)
    return names


def keep_interface(original: onnx.ModelProto, converted: onnx.ModelProto, path: str | Path,
                   version: int, target: int) -> int:
    """Give ``converted`` the graph inputs and outputs of ``original`` again; returns how many were restored.

    onnx's version converter may relabel interface shapes: Scan-8 -> 9 drops the batch axis of the
    Scan's inputs and outputs (without changing any data), and where those are graph inputs /
    outputs the user's data no longer fits. A tensor that only lost a leading axis of size 1 gets
    it back: the graph input keeps its original shape and a Squeeze (axis 0) makes
    ``<name>/unbatched`` for the Scans reading it; a graph output's producer writes
    ``<name>/unbatched`` and an Unsqueeze right after it makes ``<name>``. Other readers keep the
    original-shaped tensor, as they read it before the conversion. Any other interface change is
    a :class:`PulsarError` naming the tensor, both shapes and the fix.
    """
    g = converted.graph
    fix = f"re-export the model with opset_version={target}"
    where = f"model file {path}: converting opset {version} to {target}"
    for kind, before, after in (("input", original.graph.input, g.input), ("output", original.graph.output, g.output)):
        names_before, names_after = [v.name for v in before], [v.name for v in after]
        if names_before != names_after:
            raise PulsarError(f"{where} changes the graph {kind}s from {names_before} to {names_after}; {fix}")
    taken = _all_tensor_names(g)
    node_names = {n for n in all_node_names(g) if n}
    front: list[onnx.NodeProto] = []  # axes constants and input Squeezes, before every node
    behind: dict[int, list[onnx.NodeProto]] = {}  # id(producer) -> the Unsqueeze of its output
    graph_inputs = {v.name for v in g.input}
    restored: set[str] = set()
    for kind, before, after in (("input", original.graph.input, g.input), ("output", original.graph.output, g.output)):
        for old_vi, new_vi in zip(before, after, strict=True):
            if old_vi.type == new_vi.type:
                continue
            name = old_vi.name
            old_t, new_t = old_vi.type, new_vi.type
            tensors = old_t.HasField("tensor_type") and new_t.HasField("tensor_type")
            if not tensors or old_t.tensor_type.elem_type != new_t.tensor_type.elem_type:
                raise PulsarError(f"{where} changes the type of graph {kind} '{name}'; {fix}")
            old_dims, new_dims = dims_of(old_vi), dims_of(new_vi)
            if (old_dims is None or new_dims is None or _same_shape(old_dims, new_dims) or name in restored
                    or (kind == "output" and name in graph_inputs)):
                # No shape on one side, only symbolic dims renamed, or a tensor already restored
                # (a graph input passed through to an output): the data still fits.
                new_vi.type.CopyFrom(old_t)
                continue
            if not (old_dims[:1] == [1] and old_dims[1:] == new_dims):
                raise PulsarError(
                    f"{where} changes graph {kind} '{name}' from shape {_shape_text(old_dims)} to "
                    f"{_shape_text(new_dims)}; pulsar keeps the model's own input and output shapes, "
                    f"so {fix}"
                )
            inner = unique_name(f"{name}/unbatched", taken)
            axes = unique_name(f"{inner}/axes", taken)
            if converted.ir_version >= 4:
                add_initializer(g, axes, np.asarray([0], dtype=np.int64))
            else:  # before IR 4 every initializer is also a graph input: a Constant keeps the inputs as they are
                front.append(helper.make_node("Constant", [], [axes], value=numpy_helper.from_array(
                    np.asarray([0], dtype=np.int64)), name=unique_name(f"{axes}/Constant", node_names)))
            readers = [n for n in g.node if name in n.input]
            scans = [n for n in readers if n.op_type == "Scan"]
            if kind == "input":
                front.append(helper.make_node("Squeeze", [name, axes], [inner],
                                              name=unique_name(f"{name}/Squeeze", node_names)))
                _read_instead(scans or readers, name, inner)
            else:
                unsqueeze = helper.make_node("Unsqueeze", [inner, axes], [name],
                                             name=unique_name(f"{name}/Unsqueeze", node_names))
                producer = _rename_definition(g, name, inner)
                if producer is None:
                    front.append(unsqueeze)  # an initializer
                else:
                    behind.setdefault(id(producer), []).append(unsqueeze)
                _read_instead(scans, name, inner)
            for vi in g.value_info:
                if vi.name == name:
                    vi.name = inner
            new_vi.type.CopyFrom(old_t)
            restored.add(name)
            log.info('opset conversion dropped the leading axis of graph %s "%s"; restored shape %s',
                     kind, name, _shape_text(old_dims))
    if front or behind:
        nodes = list(front)
        for node in g.node:
            nodes.append(node)
            nodes.extend(behind.get(id(node), []))
        del g.node[:]
        g.node.extend(nodes)
    return len(restored)


def _read_instead(nodes: list[onnx.NodeProto], old: str, new: str) -> None:
    for node in nodes:
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new


def _same_shape(a: list[int | str | None], b: list[int | str | None]) -> bool:
    """Same rank and the same size wherever both sides fix one."""
    return len(a) == len(b) and all(x == y or not isinstance(x, int) or not isinstance(y, int)
                                    for x, y in zip(a, b, strict=True))


def _rename_definition(graph: onnx.GraphProto, old: str, new: str) -> onnx.NodeProto | None:
    """Make whatever defines ``old`` in ``graph`` define ``new``: the producing node (returned) or
    an initializer (None)."""
    for node in graph.node:
        for i, name in enumerate(node.output):
            if name == old:
                node.output[i] = new
                return node
    for init in graph.initializer:
        if init.name == old:
            init.name = new
    return None


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
