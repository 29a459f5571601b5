"""What a lowering rule sees and how it writes integer nodes.

A rule turns one QDQ op (its dequantized inputs, the op, an optional fused Relu / Clip and the
QuantizeLinear of each output) into ``pulsar.int`` nodes that read the input integer tensors
and write the output integer tensors under their QDQ names. It raises :class:`Unsupported` with a
one-line, user-facing reason whenever it cannot reproduce the op exactly enough (attribute, shape,
overflow guard): the op then stays on the CPU. Never silently wrong.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from pulsar.compiler.lower.qdq_graph import ACTIVATION_TYPES, QdqGraph, QParams, TensorType
from pulsar.core.fixedpoint import quantize_multiplier
from pulsar.core.int_ops import INT_DOMAIN
from pulsar.core.opdefs import code_moving_ops
from pulsar.errors import PulsarError

INT64_LIMIT = 2**62


class Unsupported(Exception):
    """The op cannot be lowered; ``str(exc)`` is the user-facing reason."""


@dataclass
class Operand:
    """One input of the QDQ op, classified.

    kind: ``act`` (a dequantized integer activation), ``qconst`` (a dequantized integer
    initializer: weight, bias, quantized constant), ``const`` (a plain initializer), ``absent``
    (optional input left out), ``float`` (a float tensor computed at run time: not quantized),
    ``runtime`` (a non-float tensor computed at run time, e.g. a shape)."""

    name: str
    kind: str
    q: QParams | None = None
    value: np.ndarray | None = None

    @property
    def is_const(self) -> bool:
        return self.kind in ("qconst", "const")

    def real(self) -> np.ndarray:
        """Real (float64) value of a constant operand."""
        if self.kind == "qconst":
            assert self.q is not None and self.value is not None
            return self.q.dequantize(self.value)
        assert self.value is not None
        return np.asarray(self.value, dtype=np.float64)


@dataclass
class LowerCtx:
    node: onnx.NodeProto
    g: QdqGraph
    inputs: list[Operand]
    outputs: list[QParams]
    clamps: list[tuple[int, int]]
    lut_items_in_bits: int = 10
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    inits: dict[str, np.ndarray] = field(default_factory=dict)       # new integer initializers
    shared_inits: list[str] = field(default_factory=list)            # QDQ initializers used as they are
    tensors: dict[str, TensorType] = field(default_factory=dict)     # new intermediate tensors
    weight_zps: dict[str, np.ndarray] = field(default_factory=dict)  # packed affine (U4) weight -> its zero points

    # ---------------------------------------------------------------- reading
    @property
    def name(self) -> str:
        return self.node.name

    @property
    def op(self) -> str:
        return self.node.op_type

    def attr(self, name: str, default=None):
        for a in self.node.attribute:
            if a.name == name:
                return helper.get_attribute_value(a)
        return default

    def attr_str(self, name: str, default: str) -> str:
        v = self.attr(name, default)
        return v.decode() if isinstance(v, bytes) else str(v)

    def operand(self, i: int) -> Operand:
        return self.inputs[i] if i < len(self.inputs) else Operand("", "absent")

    def act(self, i: int) -> QParams:
        """The per-tensor grid of activation input ``i``."""
        op = self.operand(i)
        if op.kind != "act" or op.q is None:
            raise Unsupported(f"{self.op} input {i} is not a quantized activation")
        if not op.q.per_tensor:
            raise Unsupported(f"{self.op} input '{op.name}' is quantized per channel (activations must be per tensor)")
        if op.q.elem_type not in ACTIVATION_TYPES:
            raise Unsupported(f"{self.op} input '{op.name}' has an integer type the NPU does not take")
        return op.q

    def const_value(self, i: int, what: str) -> np.ndarray | None:
        """A plain constant input (shape, axes, bounds...): None when absent, Unsupported when computed."""
        op = self.operand(i)
        if op.kind == "absent":
            return None
        if op.kind == "const":
            return op.value
        if op.kind == "qconst":
            return op.real()
        raise Unsupported(f"{self.op} {what} '{op.name}' is computed at run time; the NPU needs it constant")

    def shape(self, name: str) -> tuple[int, ...]:
        s = self.g.static_shape(name)
        if s is None:
            raise Unsupported(f"{self.op}: the shape of '{name}' is not static")
        return s

    def in_shape(self, i: int) -> tuple[int, ...]:
        return self.shape(self.node.input[i])

    def out_shape(self, i: int = 0) -> tuple[int, ...]:
        return self.shape(self.node.output[i])

    def out(self, i: int = 0) -> QParams:
        return self.outputs[i]

    def common(self, i: int = 0) -> dict[str, int]:
        """out_zp / out_min / out_max / to of output ``i`` (the fused Relu / Clip is in the bounds)."""
        q = self.outputs[i]
        lo, hi = self.clamps[i]
        return {"out_zp": q.zp, "out_min": int(lo), "out_max": int(hi), "to": q.elem_type}

    # ---------------------------------------------------------------- writing
    def emit(self, op_type: str, inputs: list[str], outputs: list[str], *, suffix: str | None = None,
             domain: str = INT_DOMAIN, **attrs) -> onnx.NodeProto:
        name = self.name if suffix is None else f"{self.name}/{suffix}"
        node = helper.make_node(op_type, inputs, outputs, name=name, domain=domain, **attrs)
        self.nodes.append(node)
        return node

    def weight_zp_inputs(self, weight: str) -> list[str]:
        """The optional zero-point input of an op reading ``weight``: [] unless the weight is a packed
        affine (U4) tensor used as stored."""
        zps = self.weight_zps.get(weight)
        return [] if zps is None else [self.add_init("w_zp", zps.astype(np.int32))]

    def add_init(self, suffix: str, value: np.ndarray) -> str:
        """A new initializer named after the node (``<node>/<suffix>``)."""
        name = f"{self.name}/{suffix}"
        self.inits[name] = np.asarray(value)
        return name

    def use_init(self, name: str) -> str:
        """An initializer of the QDQ model used unchanged (keeps its name: stored once)."""
        if name not in self.shared_inits:
            self.shared_inits.append(name)
        return name

    def declare(self, name: str, elem_type: int, shape: tuple[int, ...]) -> str:
        self.tensors[name] = TensorType(elem_type, tuple(shape))
        return name

    def multiplier(self, real, bound: int, what: str = "rescale") -> tuple[np.ndarray, np.ndarray]:
        """(M, N) for ``real`` with the accumulator bound ``bound``; Unsupported when it cannot fit."""
        if bound >= INT64_LIMIT:
            raise Unsupported(f"{self.op} accumulator bound 2^{np.log2(float(bound)):.0f} overflows int64")
        try:
            return quantize_multiplier(real, int(bound), what=f"{self.name}: {what}")
        except PulsarError as exc:
            raise Unsupported(str(exc)) from None

    def requantize(self, src: QParams, dst: QParams, clamp: tuple[int, int], x: str, y: str,
                   shape: tuple[int, ...] | None, suffix: str | None) -> None:
        """``Requantize`` from grid ``src`` to grid ``dst`` (M = 1, N = 0 on the same grid)."""
        if src.same_grid(dst):
            m, n = 1, 0
        else:
            mm, nn = self.multiplier(src.s / dst.s, src.max_centered, "requantize")
            m, n = int(mm), int(nn)
        self.emit("Requantize", [x], [y], suffix=suffix, x_zp=src.zp, M=m, N=n, out_zp=dst.zp,
                  out_min=int(clamp[0]), out_max=int(clamp[1]), to=dst.elem_type)
        if y not in {o.name for o in self.outputs}:
            assert shape is not None
            self.declare(y, dst.elem_type, tuple(shape))


def relu_clip_bounds(g: QdqGraph, node: onnx.NodeProto) -> tuple[float, float]:
    """Real bounds of a Relu / Clip (Clip bounds are inputs from opset 11, attributes before)."""
    if node.op_type == "Relu":
        return 0.0, math.inf
    if g.opset < 11:
        attrs = {a.name: a.f for a in node.attribute}
        return float(attrs.get("min", -math.inf)), float(attrs.get("max", math.inf))
    bounds = []
    for i, default in ((1, -math.inf), (2, math.inf)):
        name = node.input[i] if i < len(node.input) else ""
        if not name:
            bounds.append(default)
            continue
        value = g.const(name)
        dq = g.producer.get(name)
        if value is None and dq is not None and g.is_weight_dq(dq):
            q = g.qparams(dq)
            value = q.dequantize(g.const(dq.input[0])) if q is not None else None
        if value is None or np.asarray(value).size != 1:
            raise Unsupported("Clip bounds are computed at run time (the NPU needs constant bounds)")
        bounds.append(float(np.asarray(value).reshape(-1)[0]))
    return bounds[0], bounds[1]


def clamp_of(q: QParams, lo: float, hi: float) -> tuple[int, int]:
    """out_min / out_max on grid ``q`` of a real interval (Q is monotone: Q(clip(x)) = clip(Q(x)))."""
    out_lo = int(quantize_real(q, lo)) if math.isfinite(lo) else q.qmin
    out_hi = int(quantize_real(q, hi)) if math.isfinite(hi) else q.qmax
    return max(q.qmin, out_lo), min(q.qmax, out_hi)


def quantize_real(q: QParams, value: float | np.ndarray) -> np.ndarray:
    """onnxruntime's QuantizeLinear of ``value`` (float32 division, round half to even, saturate)."""
    v = np.asarray(value, dtype=np.float32) / np.float32(q.s)
    v = np.nan_to_num(v.astype(np.float64), nan=0.0, posinf=2.0**40, neginf=-(2.0**40))
    return np.clip(np.rint(v) + q.zp, q.qmin, q.qmax).astype(np.int64)


def full_range(q: QParams) -> tuple[int, int]:
    return q.qmin, q.qmax


def elem_np(elem_type: int) -> np.dtype:
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))


Rule = Callable[[LowerCtx], None]
RULES: dict[tuple[str, str], Rule] = {}
# Ops lowered as the standard ONNX op on the integer codes (data movement: pulsar/core/opdefs.py
# ``moves_codes``); not the quantizer's passive ops, which also share their input's scale.
PASSIVE_OPS: frozenset[str] = code_moving_ops()


def rule(*op_types: str, domain: str = "") -> Callable[[Rule], Rule]:
    """Register ``fn`` as the lowering of ``op_types`` (default domain unless ``domain``)."""
    def deco(fn: Rule) -> Rule:
        for op in op_types:
            RULES[(domain, op)] = fn
        return fn
    return deco


def find_rule(node: onnx.NodeProto) -> Rule | None:
    domain = "" if node.domain in ("", "ai.onnx") else node.domain
    return RULES.get((domain, node.op_type))


__all__ = ["INT_DOMAIN", "LowerCtx", "Operand", "PASSIVE_OPS", "RULES", "Rule", "Unsupported", "clamp_of", "elem_np",
           "find_rule", "full_range", "quantize_real", "relu_clip_bounds", "rule"]
