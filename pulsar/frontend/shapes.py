"""Input shape fixing and shape inference.

Quantization and compilation need every tensor shape known, while exported models often carry
symbolic dims (batch, height, width). ``input_shapes`` pins the graph inputs; shape inference then
propagates the fixed dims through the graph.
"""

from __future__ import annotations

import logging
import re

import onnx

from pulsar.core.graph import assign_fields
from pulsar.errors import PulsarError, did_you_mean
from pulsar.frontend.graph import dims_of, graph_input_names

log = logging.getLogger(__name__)

_FORMAT = 'expected "name:d0xd1x...;name2:..." with positive integer dims, e.g. "x:1x3x224x224"'
_DIMS = re.compile(r"^\d+(x\d+)*$")
_PROTO_LIMIT = 2**31 - 1


def parse_input_shapes(text: str) -> dict[str, list[int]]:
    """Parse ``"a:1x3x224x224;b:1x16"``; the last ``:`` splits, so names like ``in:0`` work."""
    shapes: dict[str, list[int]] = {}
    for part in (text or "").split(";"):
        part = part.strip()
        if not part:
            continue
        name, sep, dims = part.rpartition(":")
        name, dims = name.strip(), dims.strip().lower().replace(" ", "")
        if not sep or not name or not _DIMS.match(dims):
            raise PulsarError(f'input_shapes: cannot parse "{part}"; {_FORMAT}')
        values = [int(d) for d in dims.split("x")]
        if any(v <= 0 for v in values):
            raise PulsarError(f'input_shapes: "{part}" has a zero dim; dims must be positive; {_FORMAT}')
        if name in shapes:
            raise PulsarError(f'input_shapes: input "{name}" is given twice; give each input once')
        shapes[name] = values
    return shapes


def _shape_text(dims: list[int | str | None]) -> str:
    return "[" + ", ".join("?" if not isinstance(d, int) else str(d) for d in dims) + "]"


def apply_input_shapes(model: onnx.ModelProto, shapes: dict[str, list[int]]) -> onnx.ModelProto:
    """Pin graph input dims, drop shape annotations derived from the old dims, and re-infer."""
    if not shapes:
        return model
    graph = model.graph
    real_inputs = graph_input_names(graph)
    by_name = {i.name: i for i in graph.input}
    for name, dims in shapes.items():
        if name not in real_inputs:
            raise PulsarError(
                f'input_shapes: the model has no input "{name}"{did_you_mean(name, real_inputs)}; '
                f"its inputs are: {', '.join(real_inputs) or '(none)'}"
            )
        vi = by_name[name]
        if not vi.type.HasField("tensor_type"):
            raise PulsarError(f'input_shapes: input "{name}" is not a tensor, its shape cannot be set')
        old = dims_of(vi)
        if old is not None:
            if len(old) != len(dims):
                raise PulsarError(
                    f'input_shapes: input "{name}" has rank {len(old)} {_shape_text(old)} but '
                    f"{len(dims)} dims were given ({'x'.join(map(str, dims))}); give {len(old)} dims"
                )
            for axis, (was, new) in enumerate(zip(old, dims, strict=True)):
                if isinstance(was, int) and was > 0 and was != new:
                    raise PulsarError(
                        f'input_shapes: input "{name}" has fixed dim {axis} = {was} in the model '
                        f"{_shape_text(old)} but {new} was given; keep {was} there"
                    )
        shape = vi.type.tensor_type.shape
        shape.Clear()
        for d in dims:
            shape.dim.add().dim_value = int(d)
        log.info("input %s fixed to %s", name, "x".join(map(str, dims)))
    # Every intermediate and output annotation may depend on the old dims; inference rebuilds them.
    del graph.value_info[:]
    for out in graph.output:
        if out.type.HasField("tensor_type"):
            out.type.tensor_type.ClearField("shape")
    return infer_shapes(model)


def require_static_inputs(model: onnx.ModelProto) -> None:
    """Refuse graph inputs whose dims are still unknown: later stages need concrete shapes."""
    by_name = {i.name: i for i in model.graph.input}
    problems, examples = [], []
    for name in graph_input_names(model.graph):
        vi = by_name[name]
        if not vi.type.HasField("tensor_type"):
            continue
        dims = dims_of(vi)
        if dims is not None and all(isinstance(d, int) and d > 0 for d in dims):
            continue
        if dims is not None and 0 in dims:
            raise PulsarError(
                f'model input "{name}" {_shape_text(dims)} has a dimension of size 0 (an empty tensor); pulsar '
                "builds inputs that hold at least one element: give the dimension a size with `input_shapes`, "
                "or fold the empty input into the model (e.g. an empty `axes` input into the op's attribute)")
        if dims is None:
            problems.append(f'"{name}" (no shape)')
            examples.append(f"{name}:1x...")
            continue
        problems.append(f'"{name}" {_shape_text(dims)}')
        example = [str(d) if isinstance(d, int) and d > 0 else "N" for d in dims]
        example[0] = "1" if example[0] == "N" else example[0]  # unknown batch: 1 is the usual choice
        examples.append(f"{name}:{'x'.join(example)}")
    if problems:
        raise PulsarError(
            f"model input {', '.join(problems)} has unknown dims; set `input_shapes` to the sizes you "
            f'will run with, e.g. input_shapes: "{";".join(examples)}" with each N replaced by a number '
            '(like "x:1x3x48x320")'
        )


def infer_shapes(model: onnx.ModelProto, *, in_place: bool = False) -> onnx.ModelProto:
    """ONNX shape inference with data propagation; returns the model unchanged if inference fails.

    onnx's inference serializes the whole model into C++ and parses the result back: with large
    weights (a transformer's embedding tables) that copying costs far more than the inference. The
    large initializers go in as typed graph inputs instead (inference reads only their type and
    shape; data propagation needs the small shape tensors, which stay) and come back after. With
    ``in_place`` (a model the caller owns) the result is ``model`` itself with the inferred fields,
    which spares copying its large initializers once more."""
    inferred = _infer(model)
    if inferred is None or inferred is model:
        return model
    out, lifted = inferred
    if not lifted:
        return out
    del out.graph.input[len(model.graph.input):]  # the lifted weights: initializers again, in their own order
    # ``out`` with ``model``'s initializers: one C++ copy of the model (none in place), then every
    # other field of ``out`` over it (a Python-level extend of the large initializers costs three times as much)
    if in_place:
        res = model
    else:
        res = onnx.ModelProto()
        res.CopyFrom(model)
    assign_fields(res, out, skip="graph")
    assign_fields(res.graph, out.graph, skip="initializer")
    return res


def inferred_graph(model: onnx.ModelProto) -> onnx.GraphProto:
    """The graph of :func:`infer_shapes`, to read types and shapes from only: its large
    initializers are graph inputs of their type and shape (not initializers), which spares copying
    them back (a pass that reads the shapes of a large model calls this once per run)."""
    inferred = _infer(model)
    return model.graph if inferred is None or inferred is model else inferred[0].graph


def _infer(model: onnx.ModelProto) -> tuple[onnx.ModelProto, bool] | onnx.ModelProto | None:
    """(onnx's inference of ``model`` with the initializers over 64 KiB lifted to graph inputs, whether
    any were); ``model`` itself when it is over 2 GB, None when inference failed."""
    big = large_weights(model)
    if serialized_over(model, _PROTO_LIMIT, big):
        log.warning("model is over 2 GB in memory; shape inference skipped")
        return model
    try:
        if not big:
            return onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=True), False
        light = lift_weights(model, big)
        return onnx.shape_inference.infer_shapes(light, check_type=False, strict_mode=False, data_prop=True), True
    except Exception as exc:  # inference is best effort: partial info must never stop a build
        log.debug("shape inference failed: %s", exc)
        return None


def large_weights(model: onnx.ModelProto) -> set[str]:
    """Initializers over 64 KiB that are not also graph inputs: the ones worth keeping out of a copy."""
    g = model.graph
    names = {i.name for i in g.input}
    return {t.name for t in g.initializer if t.name not in names and _weight_bytes(t) > _LIFT_BYTES}


def lift_weights(model: onnx.ModelProto, big: set[str]) -> onnx.ModelProto:
    """``model`` with the initializers ``big`` as typed graph inputs (appended after the real ones), made
    without copying them: for onnx's C++ tools (inference, the version converter, the checker), which
    serialize the whole model, and read only the type and shape of a weight."""
    g = model.graph
    light = onnx.ModelProto()
    assign_fields(light, model, skip="graph")
    lg = light.graph
    assign_fields(lg, g, skip="initializer")
    lg.initializer.extend(t for t in g.initializer if t.name not in big)
    lg.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                    for t in g.initializer if t.name in big)
    return light


def serialized_over(model: onnx.ModelProto, limit: int, big: set[str] | None = None) -> bool:
    """``model.ByteSize() > limit`` without serializing (or copying) the large weights for the answer:
    the bytes the dims of the raw ``big`` initializers allow (default: those over 64 KiB) plus the
    exact size of every other part, and ``ByteSize`` itself within 64 MiB of the limit (room for the
    large tensors' headers, at most 32 Ki of them under 2 GiB, and the model's scalar fields)."""
    g = model.graph
    if big is None:
        big = {t.name for t in g.initializer if _weight_bytes(t) > _LIFT_BYTES}
    size = 0
    for t in g.initializer:  # a raw tensor holds at most dims x item size bytes (sub-byte types pack)
        size += _raw_bound(t) if t.name in big and t.HasField("raw_data") else t.ByteSize()
    size += sum(m.ByteSize() for m in (*g.node, *g.input, *g.output, *g.value_info, *g.sparse_initializer,
                                        *model.functions, *model.training_info, *model.metadata_props))
    if size < limit - (1 << 26):
        return False
    return model.ByteSize() > limit


_LIFT_BYTES = 1 << 16  # initializers larger than this skip the round trip through onnx's C++ inference


def _raw_bound(t: onnx.TensorProto) -> int:
    n = 1
    for d in t.dims:
        n *= d
    try:
        return n * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    except (KeyError, ValueError, TypeError):  # a type numpy cannot hold: its exact size
        return int(t.ByteSize())


def _weight_bytes(t: onnx.TensorProto) -> int:
    n = 1
    for d in t.dims:
        n *= d
    return n * 4 if t.data_location != onnx.TensorProto.EXTERNAL else 0
