"""Output processors: transpose / convert each model output into the form the application reads.

The graph output keeps its name (applications fetch it by name); the model's own tensor is renamed
``<name>_raw`` and any node that read it keeps reading the unprocessed value.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import onnx

from pulsar.errors import PulsarError
from pulsar.frontend.graph import dims_of, drop_value_info, producers, rename_uses
from pulsar.frontend.processors.chain import (
    DTYPES,
    FLOAT_TYPES,
    PERMS,
    Chain,
    assign,
    field,
    renamed_value_info,
    require_opset,
    set_type,
    shape_text,
    type_name,
)
from pulsar.frontend.shapes import inferred_graph

log = logging.getLogger(__name__)


def _perm(index: int, p: Any, name: str, dims: list | None) -> list[int] | None:
    """The transpose to apply: dst_perm, or NCHW->NHWC for tensor_layout NHWC (model outputs are NCHW)."""
    where = f"output_processors[{index}]"
    perm, layout = field(p, "dst_perm"), field(p, "tensor_layout")
    rank = len(dims) if dims is not None else None
    if perm is not None and layout is not None:
        raise PulsarError(f"{where}.dst_perm: give dst_perm or tensor_layout, not both (tensor_layout is {layout})")
    if perm is not None:
        perm = [int(v) for v in perm]
        if rank is None or sorted(perm) != list(range(rank)):
            raise PulsarError(f'{where}.dst_perm: {perm} is not a permutation of the {rank or "?"} axes of output '
                              f'"{name}" {shape_text(dims)}; list each axis 0..{(rank or 1) - 1} once')
        return perm
    if layout in (None, "NCHW"):
        return None
    if layout != "NHWC":
        raise PulsarError(f'{where}.tensor_layout: unknown layout "{layout}"; use NCHW or NHWC')
    if rank != 4:
        raise PulsarError(f'{where}.tensor_layout: NHWC needs a 4-D output, output "{name}" is {shape_text(dims)}')
    return PERMS[("NCHW", "NHWC")]


def _target_type(index: int, p: Any, elem_type: int) -> int:
    """FP32 converts other float outputs to float32 and leaves integer outputs (indices, counts) alone."""
    dtype = field(p, "output_dtype") or "FP32"
    if dtype not in DTYPES:
        raise PulsarError(f'output_processors[{index}].output_dtype: unknown dtype "{dtype}"; '
                          f"use one of {', '.join(DTYPES)}")
    if dtype == "FP32" and elem_type not in FLOAT_TYPES:
        return elem_type
    return DTYPES[dtype]


def attach_output_processors(model: onnx.ModelProto, processors: Sequence[Any]) -> tuple[onnx.ModelProto, list[str]]:
    """Transpose (dst_perm or tensor_layout) then convert (output_dtype, rounded and saturated) outputs.

    Returns a new model (the argument is not modified) and one log line per processed output; with
    no processors, ``model`` itself (every caller passes the fresh copy attach_input_processors made,
    and a copy of a transformer's weights costs more than the rest of this call).
    """
    if not processors:
        return model, []
    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    outputs = {vi.name: vi for vi in graph.output}
    known = {vi.name: vi for vi in [*graph.value_info, *graph.output] if dims_of(vi) is not None}
    lines = []
    for name, index, p in assign(processors, list(outputs), "output_processors", "output"):
        vi = outputs[name]
        if name not in known:  # only ask shape inference when the model does not say
            inferred = inferred_graph(result)
            known.update({v.name: v for v in [*inferred.value_info, *inferred.output] if dims_of(v) is not None})
        dims = dims_of(known[name]) if name in known else None
        elem_type = vi.type.tensor_type.elem_type
        perm = _perm(index, p, name, dims)
        target = _target_type(index, p, elem_type)
        if perm is None and target == elem_type:
            lines.append(f"{name}: nothing to do, returned as {type_name(elem_type)} {shape_text(dims)}")
            continue
        producer = producers(graph).get(name)
        if producer is None:
            raise PulsarError(f'output_processors[{index}].tensor_name: output "{name}" is a graph input or a '
                              f"constant, not computed by the model; it cannot be post-processed")
        require_opset(result, f"output_processors[{index}]")
        chain = Chain(graph, name, elem_type, None, prefix=f"{name}/post")
        raw = chain.unique(f"{name}_raw")
        rename_uses(graph, name, raw)
        producer.output[list(producer.output).index(name)] = raw
        chain.source = chain.tensor = raw
        if perm is not None:
            chain.transpose(perm, f"Transpose{perm}")
        chain.to_type(target)
        chain.install(graph, name, front=False)
        drop_value_info(graph, [name, raw])
        graph.value_info.append(renamed_value_info(vi, raw))
        new_dims = [dims[k] for k in perm] if perm is not None and dims is not None else dims
        set_type(vi, target, new_dims)
        lines.append(f"{name}: model output {type_name(elem_type)} {shape_text(dims)} -> "
                     + " -> ".join(chain.steps) + f" -> returned {type_name(target)} {shape_text(new_dims)}")
    for line in lines:
        log.debug("output processor %s", line)
    return result, lines

