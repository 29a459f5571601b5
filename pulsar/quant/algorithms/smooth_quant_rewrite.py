"""The graph side of SmoothQuant: which linear layers can take a smoothing scale ``s``, and the
edits that apply it exactly (weight rows times ``s``; ``1/s`` absorbed upstream or by an inserted
Mul). Kept apart from :mod:`smooth_quant`, which holds the statistics, the rule deciding what is
smoothed and the entry point (its docstring describes the method), so that each module stays small.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from pulsar.frontend.graph import (
    DEFAULT_DOMAINS,
    TypeInfo,
    attr,
    consumers,
    output_names,
    overridable_initializers,
    producers,
    tensor_names,
    unique_name,
)
from pulsar.frontend.passes.fold_batchnorm import scale_conv, scale_conv_transpose

_MAX_WALK = 16  # ops the division may be pushed back through


# ----------------------------------------------------------------------------------- graph view
class Graph:
    """The model being edited, with the lookups every step needs (kept current by the edits)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.g = model.graph
        self.inits = {t.name: t for t in self.g.initializer}
        self.made = producers(self.g)
        self.readers = consumers(self.g)
        self.outputs = output_names(self.g)
        self.taken = tensor_names(self.g) | {n.name for n in self.g.node}
        self.frozen = overridable_initializers(model)
        self.shape = TypeInfo.infer(model).shape
        self.pending: list[tuple[onnx.NodeProto, set[int]]] = []  # inserted Muls, ids of their readers

    def place_pending(self) -> None:
        """Put each queued Mul before its first reader. Done once at the end: rebuilding the node
        list detaches the Python references every other lookup here holds."""
        if not self.pending:
            return
        nodes = list(self.g.node)
        before: dict[int, list[onnx.NodeProto]] = {}
        for mul, ids in self.pending:
            first = min(k for k, n in enumerate(nodes) if id(n) in ids)
            before.setdefault(first, []).append(mul)
        ordered = [m for k, n in enumerate(nodes) for m in [*before.get(k, []), n]]
        del self.g.node[:]
        self.g.node.extend(ordered)
        self.pending = []

    def const(self, name: str) -> np.ndarray | None:
        t = self.inits.get(name)
        if t is None or name in self.frozen or t.data_type not in (onnx.TensorProto.FLOAT,
                                                                    onnx.TensorProto.DOUBLE,
                                                                    onnx.TensorProto.FLOAT16):
            return None
        return numpy_helper.to_array(t)

    def write(self, node: onnx.NodeProto, index: int, value: np.ndarray) -> None:
        """Give ``node.input[index]`` a new value: in place if only this node reads it."""
        name = node.input[index]
        value = value.astype(numpy_helper.to_array(self.inits[name]).dtype)
        if len(self.readers.get(name, [])) == 1 and list(node.input).count(name) == 1:
            self.inits[name].CopyFrom(numpy_helper.from_array(value, name))
            return
        new = unique_name(f"{name}_smooth", self.taken)
        self.g.initializer.append(numpy_helper.from_array(value, new))
        self.inits[new] = self.g.initializer[-1]
        node.input[index] = new
        self.readers[name] = [n for n in self.readers[name] if n is not node]
        self.readers[new] = [node]


def _channel_scale(value: np.ndarray, s: np.ndarray, axis: int, op: Callable) -> np.ndarray:
    """``op(value, s)`` with ``s`` along the negative ``axis``; a size-1 dim there is broadcast first."""
    value = np.asarray(value, dtype=np.float64)
    value = value.reshape((1,) * max(0, -axis - value.ndim) + value.shape)
    if value.shape[axis] != s.size:
        shape = list(value.shape)
        shape[axis] = s.size
        value = np.broadcast_to(value, shape)
    return op(value, s.reshape((-1,) + (1,) * (-axis - 1)))


def _fits(value: np.ndarray | None, axis: int, channels: int) -> bool:
    return value is not None and (value.ndim < -axis or value.shape[axis] in (1, channels))


# ------------------------------------------------------------------------------- linear layers
@dataclass
class Linear:
    node: onnx.NodeProto
    w_index: int    # input index of the weight
    w_axis: int     # weight axis of the input channels
    x_axis: int     # negative axis of X holding the channels
    channels: int


LINEARS: dict[str, Callable[[Graph, onnx.NodeProto], Linear | None]] = {}


def _linear(op_type: str):
    def deco(fn):
        LINEARS[op_type] = fn
        return fn
    return deco


@_linear("MatMul")
def _matmul(gv: Graph, node: onnx.NodeProto) -> Linear | None:
    w = gv.const(node.input[1])
    return Linear(node, 1, 0, -1, w.shape[0]) if w is not None and w.ndim == 2 else None


@_linear("Gemm")
def _gemm(gv: Graph, node: onnx.NodeProto) -> Linear | None:
    w = gv.const(node.input[1])
    if w is None or w.ndim != 2:
        return None
    w_axis = 1 if attr(node, "transB", 0) else 0
    return Linear(node, 1, w_axis, -2 if attr(node, "transA", 0) else -1, w.shape[w_axis])


@_linear("Conv")
def _conv(gv: Graph, node: onnx.NodeProto) -> Linear | None:
    w = gv.const(node.input[1])
    if w is None or w.ndim < 3 or attr(node, "group", 1) != 1 or any(k != 1 for k in w.shape[2:]):
        return None
    return Linear(node, 1, 1, 1 - w.ndim, w.shape[1])


def weight_absmax(gv: Graph, lin: Linear) -> np.ndarray:
    w = np.abs(gv.const(lin.node.input[lin.w_index]).astype(np.float64))
    return np.moveaxis(w, lin.w_axis, 0).reshape(lin.channels, -1).max(axis=1)


def scale_weight(gv: Graph, lin: Linear, s: np.ndarray) -> None:
    w = gv.const(lin.node.input[lin.w_index]).astype(np.float64)
    shape = [1] * w.ndim
    shape[lin.w_axis] = -1
    gv.write(lin.node, lin.w_index, w * s.reshape(shape))


# ------------------------------------------------------------------ absorbing the 1/s upstream
# A step looks at the producer of a tensor whose channels (negative axis) must be divided by s.
# It returns (edit, next): edit(s) changes the graph; next is (tensor, axis) to keep dividing, or
# None when the producer took all of it. None instead of a pair: this op cannot take it.
Edit = Callable[[np.ndarray], None]
Step = tuple[Edit, tuple[str, int] | None] | None
_ABSORBERS: dict[str, Callable[[Graph, onnx.NodeProto, int, int], Step]] = {}


def _absorber(*op_types: str):
    def deco(fn):
        for op in op_types:
            _ABSORBERS[op] = fn
        return fn
    return deco


def _divide_input(gv: Graph, node: onnx.NodeProto, index: int, axis: int, op=np.divide) -> Edit:
    def edit(s: np.ndarray) -> None:
        gv.write(node, index, _channel_scale(gv.const(node.input[index]), s, axis, op))
    return edit


def _chain(*edits: Edit) -> Edit:
    def edit(s: np.ndarray) -> None:
        for e in edits:
            e(s)
    return edit


@_absorber("LayerNormalization")
def _layernorm(gv: Graph, node: onnx.NodeProto, axis: int, channels: int) -> Step:
    # Y_j = n_j * scale_j + B_j, so Y_j / s_j comes from scale / s and B / s (channel = last axis).
    scale = gv.const(node.input[1])
    bias = gv.const(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    if axis != -1 or not _fits(scale, -1, channels) or scale.ndim == 0:
        return None
    if len(node.input) > 2 and node.input[2] and (bias is None or bias.ndim == 0 or not _fits(bias, -1, channels)):
        return None
    edits = [_divide_input(gv, node, 1, -1)] + ([_divide_input(gv, node, 2, -1)] if bias is not None else [])
    return _chain(*edits), None


@_absorber("Conv", "ConvTranspose")
def _conv_producer(gv: Graph, node: onnx.NodeProto, axis: int, channels: int) -> Step:
    w = gv.const(node.input[1])
    has_bias = len(node.input) > 2 and bool(node.input[2])
    if w is None or axis % w.ndim != 1 or (has_bias and gv.const(node.input[2]) is None):
        return None
    group = int(attr(node, "group", 1))
    scaler = scale_conv if node.op_type == "Conv" else scale_conv_transpose

    def edit(s: np.ndarray) -> None:
        gv.write(node, 1, scaler(gv.const(node.input[1]).astype(np.float64), 1.0 / s, group))
        if has_bias:
            gv.write(node, 2, gv.const(node.input[2]).astype(np.float64) / s)
    return edit, None


@_absorber("Gemm", "MatMul")
def _linear_producer(gv: Graph, node: onnx.NodeProto, axis: int, channels: int) -> Step:
    w = gv.const(node.input[1])
    if w is None or w.ndim != 2 or axis != -1:
        return None
    out_axis = 0 if node.op_type == "Gemm" and attr(node, "transB", 0) else 1
    has_bias = node.op_type == "Gemm" and len(node.input) > 2 and bool(node.input[2])
    if has_bias and not _fits(gv.const(node.input[2]), -1, channels):
        return None
    edits = [_divide_input(gv, node, 1, out_axis - 2)]  # out_axis as a negative axis of a 2-D weight
    if has_bias:
        edits.append(_divide_input(gv, node, 2, -1))
    return _chain(*edits), None


def _const_operand(gv: Graph, node: onnx.NodeProto) -> tuple[int, int] | None:
    """(index of the constant operand, index of the other) of a binary op with exactly one constant."""
    if len(node.input) != 2:
        return None
    flags = [gv.const(i) is not None for i in node.input]
    return (flags.index(True), flags.index(False)) if flags.count(True) == 1 else None


@_absorber("Mul", "Div")
def _scale_op(gv: Graph, node: onnx.NodeProto, axis: int, channels: int) -> Step:
    pair = _const_operand(gv, node)
    if pair is None or (node.op_type == "Div" and pair[0] != 1):
        return None
    if not _fits(gv.const(node.input[pair[0]]), axis, channels):
        return None
    return _divide_input(gv, node, pair[0], axis, np.divide if node.op_type == "Mul" else np.multiply), None


@_absorber("Add", "Sub")
def _shift_op(gv: Graph, node: onnx.NodeProto, axis: int, channels: int) -> Step:
    pair = _const_operand(gv, node)
    if pair is None or not _fits(gv.const(node.input[pair[0]]), axis, channels):
        return None
    other = gv.shape.get(node.input[pair[1]])
    if other is None or len(other) < -axis or other[axis] != channels:
        return None  # the other operand must really carry the channels (not broadcast along them)
    return _divide_input(gv, node, pair[0], axis), (node.input[pair[1]], axis)


@_absorber("Transpose")
def _transpose(gv: Graph, node: onnx.NodeProto, axis: int, channels: int) -> Step:
    perm = attr(node, "perm")
    if perm is None:
        return None  # default perm reverses the dims; would need the rank
    rank = len(perm)
    return (lambda s: None), (node.input[0], perm[axis % rank] - rank)


@_absorber("Reshape", "Identity")
def _reshape(gv: Graph, node: onnx.NodeProto, axis: int, channels: int) -> Step:
    if node.op_type == "Reshape":
        before, after = gv.shape.get(node.input[0]), gv.shape.get(node.output[0])
        if axis != -1 or not before or not after or before[-1] != after[-1]:
            return None  # keeping the last dim keeps every element's channel
    return (lambda s: None), (node.input[0], axis)


def absorb_plan(gv: Graph, x: str, axis: int, channels: int, layers: list[onnx.NodeProto]
                ) -> tuple[list[Edit], str] | None:
    """Edits that divide X's channels by s upstream, and the node that finally takes them.

    Every tensor on the way must feed only the next node on the way (X: only ``layers``).
    Giving other readers the tensor back through a Mul by s was tried on the torch encoder (its
    LayerNorm outputs also feed the residual Add): no better than the Mul in front of the layers.
    """
    edits: list[Edit] = []
    tensor, path_readers = x, {id(n) for n in layers}
    for _ in range(_MAX_WALK):
        if tensor in gv.outputs or {id(n) for n in gv.readers.get(tensor, [])} != path_readers:
            return None
        node = gv.made.get(tensor)
        if node is None or node.domain not in DEFAULT_DOMAINS or node.op_type not in _ABSORBERS:
            return None
        if list(node.output).index(tensor) != 0:
            return None
        step = _ABSORBERS[node.op_type](gv, node, axis, channels)
        if step is None:
            return None
        edit, nxt = step
        edits.append(edit)
        if nxt is None:
            return edits, node.name
        (tensor, axis), path_readers = nxt, {id(node)}
    return None


def insert_scale_mul(gv: Graph, x: str, axis: int, s: np.ndarray, layers: list[onnx.NodeProto]) -> str:
    """Queue X * (1/s) in front of ``layers``; :meth:`Graph.place_pending` puts it in the graph."""
    inv = (1.0 / s).astype(np.float32).reshape((-1,) + (1,) * (-axis - 1))
    const = unique_name(f"{x}_smooth_scale", gv.taken)
    out = unique_name(f"{x}_smooth", gv.taken)
    name = unique_name(f"{layers[0].name or out}/SmoothQuantMul", gv.taken)
    gv.g.initializer.append(numpy_helper.from_array(inv, const))
    gv.inits[const] = gv.g.initializer[-1]
    mul = onnx.helper.make_node("Mul", [x, const], [out], name=name)
    for n in layers:
        for k, i in enumerate(n.input):
            if i == x:
                n.input[k] = out
    known = {v.name: v for v in [*gv.g.input, *gv.g.value_info, *gv.g.output]}
    vi = onnx.ValueInfoProto()
    if x in known:
        vi.CopyFrom(known[x])
    else:
        vi.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    vi.name = out
    gv.g.value_info.append(vi)
    ids = {id(n) for n in layers}
    gv.readers[x] = [n for n in gv.readers.get(x, []) if id(n) not in ids] + [mul]
    gv.readers[out] = list(layers)
    gv.readers[const] = [mul]
    gv.made[out] = mul
    gv.pending.append((mul, ids))
    return name
