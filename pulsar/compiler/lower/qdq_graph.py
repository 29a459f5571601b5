"""Read a QDQ ONNX model: which tensors are quantized and on which integer grid.

Everything comes from the QuantizeLinear / DequantizeLinear nodes and their scale / zero-point
initializers, never from pulsar's own naming or its quant_config.json, so the lowering is a pure
function of the QDQ model and also accepts QDQ models written by other tools (onnxruntime's
quantizer). 16-bit grids use onnxruntime's ``com.microsoft`` Q / DQ, which onnx shape inference does
not know: they are inferred as Casts to the zero point's type.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from pulsar.core.tensors import initializer_array
from pulsar.frontend.graph import DEFAULT_DOMAINS, node_inputs
from pulsar.frontend.shapes import inferred_graph, large_weights, lift_weights

QDQ_DOMAINS = (*DEFAULT_DOMAINS, "com.microsoft")
INT_RANGES: dict[int, tuple[int, int]] = {
    TensorProto.INT4: (-8, 7),
    TensorProto.UINT4: (0, 15),
    TensorProto.UINT8: (0, 255),
    TensorProto.INT8: (-128, 127),
    TensorProto.UINT16: (0, 65535),
    TensorProto.INT16: (-32768, 32767),
    TensorProto.INT32: (-(2**31), 2**31 - 1),
    # float grids (FP16 / BF16 layers): the format's finite range, scale 1, no zero point
    TensorProto.FLOAT16: (-65504, 65504),
    TensorProto.BFLOAT16: (-(2**127) * 255 // 128, 2**127 * 255 // 128),
}
FLOAT_GRIDS = (TensorProto.FLOAT16, TensorProto.BFLOAT16)
ACTIVATION_TYPES = (TensorProto.UINT8, TensorProto.INT8, TensorProto.UINT16, TensorProto.INT16)
# unary ops of onnxruntime's domain whose output has its input's type and shape
_MS_SHAPE_PRESERVING = ("Gelu", "FastGelu", "QuickGelu", "BiasGelu")


def is_q(node: onnx.NodeProto) -> bool:
    return node.op_type == "QuantizeLinear" and node.domain in QDQ_DOMAINS


def is_dq(node: onnx.NodeProto) -> bool:
    return node.op_type == "DequantizeLinear" and node.domain in QDQ_DOMAINS


@dataclass(frozen=True)
class QParams:
    """The grid of one integer tensor: real = (q - zero_point) * scale."""

    name: str              # the integer tensor (a Q output, a DQ input or an int initializer)
    scale: np.ndarray      # float64, shape () per tensor or (C,) along ``axis``
    zero_point: np.ndarray  # int64, the shape of ``scale``
    elem_type: int         # TensorProto elem type of the integer tensor
    axis: int | None       # per-channel axis (None: per tensor)
    block_size: int = 0    # > 0: blocked along ``axis`` (scale: the tensor's shape with that axis / block_size)

    @property
    def per_tensor(self) -> bool:
        return self.scale.size == 1

    @property
    def s(self) -> float:
        """Per-tensor scale."""
        return float(self.scale.reshape(-1)[0])

    @property
    def zp(self) -> int:
        """Per-tensor zero point."""
        return int(self.zero_point.reshape(-1)[0])

    @property
    def qmin(self) -> int:
        return INT_RANGES[self.elem_type][0]

    @property
    def qmax(self) -> int:
        return INT_RANGES[self.elem_type][1]

    @property
    def bits(self) -> int:
        return {TensorProto.UINT16: 16, TensorProto.INT16: 16, TensorProto.INT4: 4, TensorProto.UINT4: 4,
                TensorProto.FLOAT16: 16, TensorProto.BFLOAT16: 16}.get(self.elem_type, 8)

    @property
    def is_float(self) -> bool:
        """A float grid (an FP16 / BF16 layer's tensor), written as a pair of Casts in the QDQ model."""
        return self.elem_type in FLOAT_GRIDS

    @property
    def max_centered(self) -> int:
        """Largest |q - zero_point| on this grid (the accumulator bound of one term)."""
        return max(self.zp - self.qmin, self.qmax - self.zp)

    def same_grid(self, other: QParams) -> bool:
        """Identical integers mean identical reals (float32 scales compared exactly)."""
        return (self.elem_type == other.elem_type and self.per_tensor and other.per_tensor
                and np.float32(self.s) == np.float32(other.s) and self.zp == other.zp)

    def dequantize(self, q: np.ndarray) -> np.ndarray:
        """Real values (float64) of the integers ``q`` (per channel along ``axis``)."""
        q = np.asarray(q, dtype=np.float64)
        if self.per_tensor:
            return (q - self.zp) * self.s
        shape = [1] * q.ndim
        shape[self.axis if self.axis is not None else 1] = -1
        return (q - self.zero_point.reshape(shape)) * self.scale.reshape(shape)


@dataclass(frozen=True)
class TensorType:
    elem_type: int
    shape: tuple[int | str | None, ...] | None  # None: rank unknown; a dim is an int, a symbol or None


def _fold_constant_nodes(graph: onnx.GraphProto) -> None:
    """Constant nodes become initializers so every rule sees constants one way."""
    keep = []
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in DEFAULT_DOMAINS and len(node.attribute) == 1 \
                and node.attribute[0].name == "value":
            t = onnx.TensorProto()
            t.CopyFrom(node.attribute[0].t)
            t.name = node.output[0]
            graph.initializer.append(t)
        else:
            keep.append(node)
    del graph.node[:]
    graph.node.extend(keep)


def _cast_to(node: onnx.NodeProto) -> int:
    return next((int(a.i) for a in node.attribute if a.name == "to"), 0) if node.op_type == "Cast" else 0


def _fold_widened(graph: onnx.GraphProto) -> None:
    """A 32-bit unsigned constant's widened dequantization (pulsar/quant/qdq.py: codes -> Cast(DOUBLE)
    -> Sub(zero point) -> Mul(scale) -> Cast(FLOAT)) becomes the float initializer it computes, the
    value onnxruntime computes: the rules see the constant (a LayerNorm scale folded into its
    multipliers) instead of run-time arithmetic."""
    inits = {t.name: t for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    drop: set[str] = set()
    for last in graph.node:
        if _cast_to(last) != TensorProto.FLOAT or not last.input:
            continue
        mul = producer.get(last.input[0])
        sub = producer.get(mul.input[0]) if mul is not None and mul.op_type == "Mul" else None
        widen = producer.get(sub.input[0]) if sub is not None and sub.op_type == "Sub" else None
        if widen is None or _cast_to(widen) != TensorProto.DOUBLE or widen.input[0] not in inits \
                or inits[widen.input[0]].data_type != TensorProto.UINT32 \
                or sub.input[1] not in inits or mul.input[1] not in inits:
            continue
        codes = initializer_array(inits[widen.input[0]]).astype(np.float64)
        value = (codes - initializer_array(inits[sub.input[1]])) * initializer_array(inits[mul.input[1]])
        graph.initializer.append(numpy_helper.from_array(value.astype(np.float32), last.output[0]))
        drop.update(n.output[0] for n in (widen, sub, mul, last))
    if drop:
        keep = [n for n in graph.node if not n.output or n.output[0] not in drop]
        del graph.node[:]
        graph.node.extend(keep)


def _name_nodes(graph: onnx.GraphProto) -> None:
    """Every node gets a unique, non-empty name: integer nodes and fallbacks are reported by it."""
    seen: set[str] = set()
    for i, node in enumerate(graph.node):
        base = node.name or f"{node.op_type}_{i}"
        name, k = base, 1
        while name in seen:
            name, k = f"{base}__{k}", k + 1
        node.name = name
        seen.add(name)


def _zero_point_type(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> int | None:
    if len(node.input) > 2 and node.input[2] in inits:
        return inits[node.input[2]].data_type
    for a in node.attribute:
        if a.name == "output_dtype" and a.i:
            return int(a.i)
    return TensorProto.UINT8 if len(node.input) <= 2 else None


def inferable(model: onnx.ModelProto, inits: dict[str, onnx.TensorProto] | None = None) -> onnx.ModelProto:
    """A copy of ``model`` that onnx shape inference understands: com.microsoft Q / DQ as Casts (their
    zero points' types from ``inits``, default the model's initializers)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    inits = {t.name: t for t in g.initializer} if inits is None else inits
    nodes = []
    for node in g.node:
        if node.domain == "com.microsoft" and (is_q(node) or is_dq(node)):
            to = _zero_point_type(node, inits) if is_q(node) else TensorProto.FLOAT
            nodes.append(helper.make_node("Cast", [node.input[0]], [node.output[0]], to=to or TensorProto.UINT8))
        elif node.domain == "com.microsoft" and node.op_type in _MS_SHAPE_PRESERVING:
            nodes.append(helper.make_node("Identity", [node.input[0]], [node.output[0]]))
        else:
            nodes.append(node)
    del g.node[:]
    g.node.extend(nodes)
    return m


def infer_types(model: onnx.ModelProto) -> dict[str, TensorType]:
    """Elem type and shape of every tensor, with com.microsoft Q / DQ read as Casts."""
    # read only: the large weights go in as typed inputs (lift_weights), so neither the copy that
    # renames the Q / DQ nodes nor the inference copies them
    inits = {t.name: t for t in model.graph.initializer}  # a lifted zero point still gives its type
    g = inferred_graph(inferable(lift_weights(model, large_weights(model)), inits))
    types: dict[str, TensorType] = {}
    for vi in [*g.value_info, *g.input, *g.output]:
        t = vi.type.tensor_type
        if not vi.type.HasField("tensor_type") or not t.elem_type:
            continue
        shape = None
        if t.HasField("shape"):
            shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim)
        types[vi.name] = TensorType(t.elem_type, shape)
    for t in g.initializer:
        types[t.name] = TensorType(t.data_type, tuple(t.dims))
    return types


class QdqGraph:
    """A QDQ model with the questions the lowering asks answered once."""

    def __init__(self, qmodel: onnx.ModelProto) -> None:
        model = onnx.ModelProto()
        model.CopyFrom(qmodel)
        _fold_constant_nodes(model.graph)
        _fold_widened(model.graph)
        _name_nodes(model.graph)
        self.model = model
        self.graph = model.graph
        self.opset = next((o.version for o in model.opset_import if o.domain in DEFAULT_DOMAINS), 1)
        self.inits: dict[str, onnx.TensorProto] = {t.name: t for t in self.graph.initializer}
        self.producer: dict[str, onnx.NodeProto] = {o: n for n in self.graph.node for o in n.output if o}
        self.consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for n in self.graph.node:
            for name in dict.fromkeys(node_inputs(n)):
                self.consumers[name].append(n)
        self.graph_inputs = [i for i in self.graph.input if i.name not in self.inits]
        self.graph_outputs = list(self.graph.output)
        self.output_names = {o.name for o in self.graph.output}
        self.types = infer_types(model)
        self._consts: dict[str, np.ndarray] = {}
        # Cast pairs standing for a float grid: Cast(to FP16 / BF16) is its "Q", the Cast back to FLOAT
        # of such a Cast's output (or of an FP16 / BF16 initializer) its "DQ".
        self.float_q: dict[str, int] = {}
        self.float_dq: dict[str, int] = {}
        for n in self.graph.node:
            if n.op_type != "Cast" or n.domain not in DEFAULT_DOMAINS:
                continue
            to = next((int(a.i) for a in n.attribute if a.name == "to"), 0)
            if to in FLOAT_GRIDS:
                self.float_q[n.name] = to
        made = {o: self.float_q[n.name] for n in self.graph.node if n.name in self.float_q for o in n.output}
        made.update({t.name: t.data_type for t in self.graph.initializer if t.data_type in FLOAT_GRIDS})
        for n in self.graph.node:
            if n.op_type == "Cast" and n.domain in DEFAULT_DOMAINS and n.input and n.input[0] in made and \
                    next((int(a.i) for a in n.attribute if a.name == "to"), 0) == TensorProto.FLOAT:
                self.float_dq[n.name] = made[n.input[0]]

    def is_q(self, node: onnx.NodeProto) -> bool:
        """A QuantizeLinear or a float grid's Cast(to FP16 / BF16)."""
        return is_q(node) or node.name in self.float_q

    def is_dq(self, node: onnx.NodeProto) -> bool:
        """A DequantizeLinear or a float grid's Cast back to FLOAT."""
        return is_dq(node) or node.name in self.float_dq

    # ---------------------------------------------------------------- constants
    def const(self, name: str) -> np.ndarray | None:
        """Value of an initializer (None for a run-time tensor)."""
        if name not in self.inits:
            return None
        if name not in self._consts:
            self._consts[name] = initializer_array(self.inits[name])  # 4-bit weights as int8 / uint8
        return self._consts[name]

    def is_weight_dq(self, node: onnx.NodeProto) -> bool:
        """A DQ of a constant integer initializer (weight, bias, quantized constant operand)."""
        return self.is_dq(node) and node.input[0] in self.inits

    # ---------------------------------------------------------------- grids
    def qparams(self, node: onnx.NodeProto) -> QParams | None:
        """Grid of a Q node's output or a DQ node's input; None when it is not a plain linear grid."""
        fmt = self.float_q.get(node.name) or self.float_dq.get(node.name)
        if fmt:
            name = node.output[0] if node.name in self.float_q else node.input[0]
            return QParams(name, np.asarray(1.0), np.asarray(0, dtype=np.int64), fmt, None)
        if len(node.input) < 2:
            return None
        block = next((int(a.i) for a in node.attribute if a.name == "block_size"), 0)
        scale = self.const(node.input[1])
        if scale is None:
            return None
        scale = np.asarray(scale, dtype=np.float64)
        if len(node.input) > 2 and node.input[2]:
            zp_arr = self.const(node.input[2])
            if zp_arr is None:
                return None
            zero_point = np.asarray(zp_arr, dtype=np.int64)
            elem_type = self.inits[node.input[2]].data_type
        else:
            zero_point = np.zeros(scale.shape, dtype=np.int64)
            elem_type = _zero_point_type(node, self.inits) if is_q(node) else \
                self.elem_type(node.input[0]) or TensorProto.UINT8
        if elem_type not in INT_RANGES or (scale.ndim > 1 and not block) or zero_point.shape != scale.shape:
            return None
        if not np.all(np.isfinite(scale)) or np.any(scale <= 0):
            return None
        axis = None
        if scale.size > 1 or scale.ndim == 1:
            axis = next((int(a.i) for a in node.attribute if a.name == "axis"), 1)
            rank = self.rank(node.input[0] if is_dq(node) else node.output[0])
            if axis < 0 and rank is not None:
                axis += rank
        if scale.size == 1:
            axis = None
        name = node.output[0] if is_q(node) else node.input[0]
        return QParams(name, scale, zero_point, elem_type, axis, block)

    # ---------------------------------------------------------------- types
    def elem_type(self, name: str) -> int | None:
        t = self.types.get(name)
        return t.elem_type if t else None

    def shape(self, name: str) -> tuple[int | str | None, ...] | None:
        t = self.types.get(name)
        return t.shape if t else None

    def static_shape(self, name: str) -> tuple[int, ...] | None:
        s = self.shape(name)
        if s is None or not all(isinstance(d, int) and d > 0 for d in s):
            return None
        return tuple(int(d) for d in s)

    def rank(self, name: str) -> int | None:
        s = self.shape(name)
        return None if s is None else len(s)
