"""A linear chain of ONNX nodes grown from one tensor, plus what input and output processors share.

Pre- and postprocessing are both "start from a tensor, apply a few standard ops, hand the result to
a fixed name". :class:`Chain` collects the nodes and constants off-graph, so nothing in the model
changes until :meth:`Chain.install` splices them in, and an empty chain leaves the model untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from pulsar.errors import PulsarError, did_you_mean
from pulsar.frontend.graph import (
    DEFAULT_DOMAINS,
    all_node_names,
    tensor_names,
    unique_name,
)

#: Config dtype names -> ONNX element types.
DTYPES: dict[str, int] = {
    "U8": TensorProto.UINT8,
    "S8": TensorProto.INT8,
    "U16": TensorProto.UINT16,
    "S16": TensorProto.INT16,
    "FP32": TensorProto.FLOAT,
}
FLOAT_TYPES = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16}
#: Channel axis of a 4-D tensor per layout.
CHANNEL_AXIS = {"NCHW": 1, "NHWC": 3}
#: Spatial (H, W) axes of a 4-D tensor per layout.
SPATIAL_AXES = {"NCHW": (2, 3), "NHWC": (1, 2)}
#: Transpose permutations between the two 4-D layouts: PERMS[(src, dst)].
PERMS = {("NHWC", "NCHW"): [0, 3, 1, 2], ("NCHW", "NHWC"): [0, 2, 3, 1]}
MIN_OPSET = 11  # Pad / Clip / Resize with tensor inputs, Round
DEFAULT = "DEFAULT"

Dims = list[int | str | None]


def type_name(elem_type: int) -> str:
    return TensorProto.DataType.Name(elem_type).lower()


def shape_text(dims: Dims | None) -> str:
    if dims is None:
        return "[?]"
    return "[" + ", ".join(str(d) if d is not None else "?" for d in dims) + "]"


def field(p: Any, name: str) -> Any:
    """A processor field; missing and None both mean unset."""
    return getattr(p, name, None)


def assign(processors: Sequence[Any], names: Sequence[str], section: str, kind: str) -> list[tuple[str, int, Any]]:
    """Pair each tensor with its processor: its own entry, else the DEFAULT entry, else none.

    Returns (tensor name, processor index, processor) in ``names`` order.
    """
    own: dict[str, int] = {}
    default: int | None = None
    for i, p in enumerate(processors):
        name = field(p, "tensor_name")
        where = f"{section}[{i}].tensor_name"
        if name == DEFAULT:
            if default is not None:
                raise PulsarError(f"{where}: DEFAULT is also used by {section}[{default}]; keep one DEFAULT entry")
            default = i
        elif name not in names:
            raise PulsarError(
                f'{where}: the model has no {kind} "{name}"{did_you_mean(name, names)}; '
                f"its {kind}s are: {', '.join(names) or '(none)'} (or use DEFAULT)"
            )
        elif name in own:
            raise PulsarError(f'{where}: {kind} "{name}" already has {section}[{own[name]}]; give each {kind} once')
        else:
            own[name] = i
    result = []
    for name in names:
        index = own.get(name, default)
        if index is not None:
            result.append((name, index, processors[index]))
    return result


def require_opset(model: onnx.ModelProto, section: str) -> None:
    version = next((o.version for o in model.opset_import if o.domain in DEFAULT_DOMAINS), 0)
    if version < MIN_OPSET:
        raise PulsarError(
            f"{section}: the model uses ONNX opset {version}, the processors need opset {MIN_OPSET} or newer; "
            f"convert it first (onnx.version_converter.convert_version(model, 13))"
        )


def integer_range(elem_type: int) -> tuple[int, int]:
    info = np.iinfo(helper.tensor_dtype_to_np_dtype(elem_type))
    return int(info.min), int(info.max)


class Chain:
    """Nodes applied one after the other to ``tensor`` (with side branches where needed)."""

    def __init__(self, graph: onnx.GraphProto, source: str, elem_type: int, layout: str | None, prefix: str):
        self._taken = tensor_names(graph) | set(all_node_names(graph)) | {o.name for o in graph.output}
        self.prefix = prefix
        self.source = source
        self.tensor = source
        self.elem_type = elem_type
        self.layout = layout
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self.steps: list[str] = []

    def unique(self, base: str) -> str:
        return unique_name(base, self._taken)

    def const(self, suffix: str, value: Any, dtype: Any = None) -> str:
        name = self.unique(f"{self.prefix}/{suffix}")
        self.initializers.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def op(self, op_type: str, inputs: Sequence[str], **attrs: Any) -> str:
        """Add a node on explicit inputs; returns its output, ``tensor`` is unchanged."""
        out = self.unique(f"{self.prefix}/{op_type.lower()}")
        name = self.unique(f"{self.prefix}/{op_type}")
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=name, **attrs))
        return out

    def apply(self, op_type: str, *extra: str, **attrs: Any) -> str:
        """Add a node reading the current tensor; its output becomes the current tensor."""
        self.tensor = self.op(op_type, [self.tensor, *extra], **attrs)
        return self.tensor

    # ---- building blocks shared by input and output processors -------------------------------

    def cast(self, elem_type: int) -> None:
        if elem_type != self.elem_type:
            self.apply("Cast", to=elem_type)
            self.steps.append(f"Cast({type_name(elem_type)})")
            self.elem_type = elem_type

    def to_type(self, elem_type: int) -> None:
        """Convert to ``elem_type``; integer targets are rounded (half to even) and saturated first."""
        if elem_type == self.elem_type:
            return
        if elem_type in FLOAT_TYPES:
            self.cast(elem_type)
            return
        self.cast(TensorProto.FLOAT)
        lo, hi = integer_range(elem_type)
        self.apply("Round")
        self.apply("Clip", self.const("lo", lo, np.float32), self.const("hi", hi, np.float32))
        self.apply("Cast", to=elem_type)
        self.elem_type = elem_type
        self.steps.append(f"round, saturate to [{lo}, {hi}], Cast({type_name(elem_type)})")

    def transpose(self, perm: Sequence[int], step: str) -> None:
        if list(perm) != list(range(len(perm))):
            self.apply("Transpose", perm=list(perm))
            self.steps.append(step)

    def to_layout(self, layout: str) -> None:
        if self.layout != layout:
            self.transpose(PERMS[(self.layout, layout)], f"{self.layout}->{layout}")
            self.layout = layout

    # ---- splicing into the graph --------------------------------------------------------------

    def install(self, graph: onnx.GraphProto, output: str, *, front: bool) -> None:
        """Name the chain's result ``output`` and add nodes (first in the graph when ``front``)."""
        self.nodes[-1].output[0] = output  # the last node produces self.tensor, no chain node reads it
        self.tensor = output
        nodes = [*self.nodes, *graph.node] if front else [*graph.node, *self.nodes]
        del graph.node[:]
        graph.node.extend(nodes)
        graph.initializer.extend(self.initializers)


def set_type(vi: onnx.ValueInfoProto, elem_type: int, dims: Dims | None) -> None:
    """Rewrite a value_info's element type and shape in place (None dims: shape unknown)."""
    fresh = helper.make_tensor_value_info(vi.name, elem_type, dims)
    fresh.doc_string = vi.doc_string
    vi.CopyFrom(fresh)


def renamed_value_info(vi: onnx.ValueInfoProto, name: str) -> onnx.ValueInfoProto:
    copy = onnx.ValueInfoProto()
    copy.CopyFrom(vi)
    copy.name = name
    copy.doc_string = ""
    return copy
