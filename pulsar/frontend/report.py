"""Size and cost of a float graph: node / op counts, parameters and multiply-accumulates (MACs).

The frontend shows these before and after optimization so a user sees what the passes bought, and
later stages (performance estimates) need a MAC figure per graph. MACs follow the usual convention
of model zoos (thop, fvcore): one multiply-add of a weight with an activation is one MAC; bias
additions, normalizations, activations and other elementwise or data-movement ops count 0, since
their cost is memory traffic rather than arithmetic.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import onnx

from pulsar.core.graph import subgraphs
from pulsar.frontend.graph import DEFAULT_DOMAINS, TypeInfo, attr
from pulsar.frontend.pass_manager import op_histogram
from pulsar.frontend.shapes import inferred_graph

__all__ = ["GraphSummary", "MAC_COUNTERS", "frontend_report_rows", "human_count", "summarize"]

log = logging.getLogger(__name__)

_FLOAT_TYPES = frozenset(
    getattr(onnx.TensorProto, name)
    for name in (
        "FLOAT", "FLOAT16", "DOUBLE", "BFLOAT16",
        "FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ", "FLOAT4E2M1",
    )
    if hasattr(onnx.TensorProto, name)
)  # fmt: skip

Shape = tuple[int, ...]
# node, static shapes by tensor name -> MACs, or None when a needed shape is unknown
MacCounter = Callable[[onnx.NodeProto, dict[str, Shape]], "int | None"]
MAC_COUNTERS: dict[str, MacCounter] = {}


@dataclass
class GraphSummary:
    """What :func:`summarize` measured; ``macs_unknown`` counts compute nodes left out of ``macs``
    because shape inference could not size them (so ``macs`` is then a lower bound)."""

    nodes: int
    op_counts: dict[str, int]
    params: int
    macs: int
    macs_unknown: int = 0


def mac_counter(*op_types: str) -> Callable[[MacCounter], MacCounter]:
    """Register the MAC formula of default-domain ``op_types``; other ops count 0."""

    def decorator(fn: MacCounter) -> MacCounter:
        for op_type in op_types:
            MAC_COUNTERS[op_type] = fn
        return fn

    return decorator


def _shapes_of(node: onnx.NodeProto, shapes: dict[str, Shape], count: int) -> list[Shape] | None:
    names = list(node.input[:count])
    if len(names) < count or not all(n in shapes for n in names):
        return None
    return [shapes[n] for n in names]


def _conv_output_spatial(node: onnx.NodeProto, x: Shape, w: Shape) -> list[int]:
    """Output spatial dims from the Conv attributes, for when inference left the output unsized."""
    spatial, kernel = x[2:], w[2:]
    n = len(spatial)
    strides = attr(node, "strides") or [1] * n
    dilations = attr(node, "dilations") or [1] * n
    auto_pad = attr(node, "auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        return [math.ceil(s / st) for s, st in zip(spatial, strides, strict=True)]
    pads = [0] * (2 * n) if auto_pad == "VALID" else (attr(node, "pads") or [0] * (2 * n))
    return [
        (s + pads[i] + pads[i + n] - (d * (k - 1) + 1)) // st + 1
        for i, (s, k, st, d) in enumerate(zip(spatial, kernel, strides, dilations, strict=True))
    ]


@mac_counter("Conv")
def _conv_macs(node: onnx.NodeProto, shapes: dict[str, Shape]) -> int | None:
    """out elements x (C / groups) x kernel area: each output reads C/groups channels of its group;
    dilation spreads the kernel but only changes the output size, which the output shape holds."""
    found = _shapes_of(node, shapes, 2)
    if found is None:
        return None
    x, w = found
    out = shapes.get(node.output[0])
    if out is None:
        out = (x[0], w[0], *_conv_output_spatial(node, x, w))
    return math.prod(out) * math.prod(w[1:])  # w = [M, C/groups, *kernel]


@mac_counter("ConvTranspose")
def _conv_transpose_macs(node: onnx.NodeProto, shapes: dict[str, Shape]) -> int | None:
    """Every input element is multiplied by one (M/groups) x kernel slice of the weights."""
    found = _shapes_of(node, shapes, 2)
    if found is None:
        return None
    x, w = found
    return math.prod(x) * math.prod(w[1:])  # w = [C, M/groups, *kernel]


@mac_counter("Gemm")
def _gemm_macs(node: onnx.NodeProto, shapes: dict[str, Shape]) -> int | None:
    found = _shapes_of(node, shapes, 2)
    if found is None:
        return None
    a, b = found
    if len(a) != 2 or len(b) != 2:
        return None
    m, k = (a[1], a[0]) if attr(node, "transA", 0) else a
    n = b[0] if attr(node, "transB", 0) else b[1]
    return m * k * n


@mac_counter("MatMul")
def _matmul_macs(node: onnx.NodeProto, shapes: dict[str, Shape]) -> int | None:
    """numpy matmul semantics: 1-D operands get a unit M / N, leading dims broadcast as a batch."""
    found = _shapes_of(node, shapes, 2)
    if found is None:
        return None
    a, b = found
    if not a or not b:
        return None
    m = a[-2] if len(a) >= 2 else 1
    n = b[-1] if len(b) >= 2 else 1
    batch = _broadcast(a[:-2], b[:-2])
    return None if batch is None else math.prod(batch) * m * a[-1] * n


def _broadcast(a: Sequence[int], b: Sequence[int]) -> Shape | None:
    width = max(len(a), len(b))
    a, b = (1,) * (width - len(a)) + tuple(a), (1,) * (width - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b, strict=True):
        if x != y and 1 not in (x, y):
            return None
        out.append(y if x == 1 else x)
    return tuple(out)


def _float_elements(graph: onnx.GraphProto) -> int:
    """Float weights: initializers plus Constant nodes (Paddle exports keep weights in those)."""
    total = sum(math.prod(t.dims) for t in graph.initializer if t.data_type in _FLOAT_TYPES)
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in DEFAULT_DOMAINS:
            for a in node.attribute:
                if a.name == "value" and a.t.data_type in _FLOAT_TYPES:
                    total += math.prod(a.t.dims)
                elif a.name == "value_floats":
                    total += len(a.floats)
                elif a.name == "value_float":
                    total += 1
        for sub in subgraphs(node):
            total += _float_elements(sub)
    return total


def _compute_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    return [n for n in graph.node if n.domain in DEFAULT_DOMAINS and n.op_type in MAC_COUNTERS]


def _static_shapes(model: onnx.ModelProto | onnx.GraphProto) -> dict[str, Shape]:
    return TypeInfo(model).shape


def summarize(model: onnx.ModelProto) -> GraphSummary:
    """Nodes, op histogram, float parameter count and MACs of ``model`` (left unchanged).

    Shapes come from the model's value_info, or from shape inference on a copy when a compute
    node's tensors are not all sized there. MACs cover the main graph only: the trip count of a
    Loop body or the branch an If takes is unknown statically.
    """
    compute = _compute_nodes(model.graph)
    shapes = _static_shapes(model)
    needed = {n for node in compute for n in [*node.input[:2], node.output[0]] if n}
    if needed - shapes.keys():
        shapes = _static_shapes(inferred_graph(model))
    macs, unknown = 0, 0
    for node in compute:
        count = MAC_COUNTERS[node.op_type](node, shapes)
        if count is None:
            unknown += 1
            log.debug("MACs of %s (%s) unknown: its input shapes are not static", node.name, node.op_type)
        else:
            macs += count
    counts = op_histogram(model)
    return GraphSummary(
        nodes=sum(counts.values()),
        op_counts=counts,
        params=_float_elements(model.graph),
        macs=macs,
        macs_unknown=unknown,
    )


def human_count(value: int) -> str:
    """Exact below 10000, else three significant digits and a suffix: 3504872 -> "3.50M"."""
    if abs(value) < 10_000:
        return str(value)
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        scaled = abs(value) / scale
        if round(scaled, 2) >= 1:
            digits = 0 if scaled >= 99.95 else 1 if scaled >= 9.995 else 2
            return f"{value / scale:.{digits}f}{suffix}"
    return str(value)


def _macs_text(summary: GraphSummary) -> str:
    text = human_count(summary.macs)
    if summary.macs_unknown:
        text += f"+ ({summary.macs_unknown} op(s) of unknown shape)"
    return text


def frontend_report_rows(before: GraphSummary, after: GraphSummary) -> list[tuple[str, str, str]]:
    """(label, before, after) rows: every op type (most frequent before first), then nodes, params, MACs."""
    ops = sorted(
        set(before.op_counts) | set(after.op_counts),
        key=lambda op: (-before.op_counts.get(op, 0), -after.op_counts.get(op, 0), op),
    )
    rows = [(op, str(before.op_counts.get(op, 0)), str(after.op_counts.get(op, 0))) for op in ops]
    rows.append(("nodes", str(before.nodes), str(after.nodes)))
    rows.append(("params", human_count(before.params), human_count(after.params)))
    rows.append(("MACs", _macs_text(before), _macs_text(after)))
    return rows
