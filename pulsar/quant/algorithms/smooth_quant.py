"""SmoothQuant (Xiao et al. 2022, arXiv 2211.10438): move activation outliers into the weights.

A per-tensor U8 grid wastes most of its levels when a few channels of a linear layer's input are
much larger than the rest. Dividing input channel j by s_j and multiplying row j of the weight by
s_j leaves the float product unchanged while flattening the activation; per-output-channel S8
weights absorb the extra range far better. This runs on the float graph after the frontend and
before calibration, so calibration sees the smoothed tensors.

Layers: MatMul with a constant 2-D weight, Gemm with a constant B, and pointwise (1x1, group 1)
Conv. Every such layer reading the same tensor X (Q / K / V projections) shares one ``s``, built
from the largest weight row over all of them:

    s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha), clipped to [1e-5, 1e5]
    (s_j = 1 for a channel whose activation or weight maximum is 0)

The division by ``s`` is pushed back from X through ops that carry channels unchanged
(Transpose, Identity, Reshape keeping the last dim, Add / Sub of a constant, whose constant is
divided too) into the first op that can take it exactly: LayerNormalization (Scale and B),
Conv / ConvTranspose / Gemm / MatMul with constant weights (their output channels and bias), or a
Mul / Div by a constant. Every tensor on that path must feed nothing else. Where no such op is
found, a Mul by the constant 1/s is inserted in front of the layers. That is exact in float too,
and since pulsar quantizes the Mul like any other op, X itself is still quantized with its
outliers; the layers' own input and their weights are smoothed all the same, which is where the
weight error (multiplied by that input) comes from. On the example torch encoder, where every
layer goes this way, it cut the QDQ output error by 15-18% at threshold 1; ``insert_mul=False``
skips such layers instead.

Which layers are smoothed (``threshold`` = quant.smooth_quant_threshold, 0..1): with m_j the
per-channel max|X_j| over all samples, a layer's ``outlier_ratio`` is max_j m_j / median_j m_j
(>= 1). It is smoothed when ``outlier_ratio >= 1 / threshold``: threshold 0 smooths nothing,
0.2 (the default) needs the largest channel at 5x the median one, 1 smooths every candidate
whose input is not all zero. A larger threshold never smooths fewer layers. Each candidate gets
a :class:`SmoothReport`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from pulsar.errors import PulsarError
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
from pulsar.quant.calibrate import _make_feed, _session

log = logging.getLogger(__name__)

__all__ = ["SCALE_RANGE", "SmoothReport", "apply_smooth_quant"]

SCALE_RANGE = (1e-5, 1e5)
_MAX_WALK = 16  # ops the division may be pushed back through


@dataclass
class SmoothReport:
    layer: str             # the linear node
    op_type: str
    input: str             # the activation X it reads (name in the model given)
    outlier_ratio: float   # max / median of the per-channel max|X|
    smoothed: bool
    max_scale: float       # largest s_j applied (1.0 when not smoothed)
    absorbed_into: str = ""  # node that took the 1/s: a producer or the inserted Mul; "" if none


# ----------------------------------------------------------------------------------- graph view
class _Graph:
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
class _Linear:
    node: onnx.NodeProto
    w_index: int    # input index of the weight
    w_axis: int     # weight axis of the input channels
    x_axis: int     # negative axis of X holding the channels
    channels: int


_LINEARS: dict[str, Callable[[_Graph, onnx.NodeProto], _Linear | None]] = {}


def _linear(op_type: str):
    def deco(fn):
        _LINEARS[op_type] = fn
        return fn
    return deco


@_linear("MatMul")
def _matmul(gv: _Graph, node: onnx.NodeProto) -> _Linear | None:
    w = gv.const(node.input[1])
    return _Linear(node, 1, 0, -1, w.shape[0]) if w is not None and w.ndim == 2 else None


@_linear("Gemm")
def _gemm(gv: _Graph, node: onnx.NodeProto) -> _Linear | None:
    w = gv.const(node.input[1])
    if w is None or w.ndim != 2:
        return None
    w_axis = 1 if attr(node, "transB", 0) else 0
    return _Linear(node, 1, w_axis, -2 if attr(node, "transA", 0) else -1, w.shape[w_axis])


@_linear("Conv")
def _conv(gv: _Graph, node: onnx.NodeProto) -> _Linear | None:
    w = gv.const(node.input[1])
    if w is None or w.ndim < 3 or attr(node, "group", 1) != 1 or any(k != 1 for k in w.shape[2:]):
        return None
    return _Linear(node, 1, 1, 1 - w.ndim, w.shape[1])


def _weight_absmax(gv: _Graph, lin: _Linear) -> np.ndarray:
    w = np.abs(gv.const(lin.node.input[lin.w_index]).astype(np.float64))
    return np.moveaxis(w, lin.w_axis, 0).reshape(lin.channels, -1).max(axis=1)


def _scale_weight(gv: _Graph, lin: _Linear, s: np.ndarray) -> None:
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
_ABSORBERS: dict[str, Callable[[_Graph, onnx.NodeProto, int, int], Step]] = {}


def _absorber(*op_types: str):
    def deco(fn):
        for op in op_types:
            _ABSORBERS[op] = fn
        return fn
    return deco


def _divide_input(gv: _Graph, node: onnx.NodeProto, index: int, axis: int, op=np.divide) -> Edit:
    def edit(s: np.ndarray) -> None:
        gv.write(node, index, _channel_scale(gv.const(node.input[index]), s, axis, op))
    return edit


def _chain(*edits: Edit) -> Edit:
    def edit(s: np.ndarray) -> None:
        for e in edits:
            e(s)
    return edit


@_absorber("LayerNormalization")
def _layernorm(gv: _Graph, node: onnx.NodeProto, axis: int, channels: int) -> Step:
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
def _conv_producer(gv: _Graph, node: onnx.NodeProto, axis: int, channels: int) -> Step:
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
def _linear_producer(gv: _Graph, node: onnx.NodeProto, axis: int, channels: int) -> Step:
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


def _const_operand(gv: _Graph, node: onnx.NodeProto) -> tuple[int, int] | None:
    """(index of the constant operand, index of the other) of a binary op with exactly one constant."""
    if len(node.input) != 2:
        return None
    flags = [gv.const(i) is not None for i in node.input]
    return (flags.index(True), flags.index(False)) if flags.count(True) == 1 else None


@_absorber("Mul", "Div")
def _scale_op(gv: _Graph, node: onnx.NodeProto, axis: int, channels: int) -> Step:
    pair = _const_operand(gv, node)
    if pair is None or (node.op_type == "Div" and pair[0] != 1):
        return None
    if not _fits(gv.const(node.input[pair[0]]), axis, channels):
        return None
    return _divide_input(gv, node, pair[0], axis, np.divide if node.op_type == "Mul" else np.multiply), None


@_absorber("Add", "Sub")
def _shift_op(gv: _Graph, node: onnx.NodeProto, axis: int, channels: int) -> Step:
    pair = _const_operand(gv, node)
    if pair is None or not _fits(gv.const(node.input[pair[0]]), axis, channels):
        return None
    other = gv.shape.get(node.input[pair[1]])
    if other is None or len(other) < -axis or other[axis] != channels:
        return None  # the other operand must really carry the channels (not broadcast along them)
    return _divide_input(gv, node, pair[0], axis), (node.input[pair[1]], axis)


@_absorber("Transpose")
def _transpose(gv: _Graph, node: onnx.NodeProto, axis: int, channels: int) -> Step:
    perm = attr(node, "perm")
    if perm is None:
        return None  # default perm reverses the dims; would need the rank
    rank = len(perm)
    return (lambda s: None), (node.input[0], perm[axis % rank] - rank)


@_absorber("Reshape", "Identity")
def _reshape(gv: _Graph, node: onnx.NodeProto, axis: int, channels: int) -> Step:
    if node.op_type == "Reshape":
        before, after = gv.shape.get(node.input[0]), gv.shape.get(node.output[0])
        if axis != -1 or not before or not after or before[-1] != after[-1]:
            return None  # keeping the last dim keeps every element's channel
    return (lambda s: None), (node.input[0], axis)


def _absorb_plan(gv: _Graph, x: str, axis: int, channels: int, layers: list[onnx.NodeProto]
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


def _insert_mul(gv: _Graph, x: str, axis: int, s: np.ndarray, layers: list[onnx.NodeProto]) -> str:
    """Queue X * (1/s) in front of ``layers``; :meth:`_Graph.place_pending` puts it in the graph."""
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


# ------------------------------------------------------------------------------- statistics
def _channel_absmax(model: onnx.ModelProto, wanted: Iterable[tuple[str, int]],
                    samples: Iterable[dict[str, np.ndarray]]) -> dict[tuple[str, int], np.ndarray]:
    """Running per-channel max|X| (channel = the negative axis) over all samples: one sample alive."""
    g = model.graph
    init_names = {t.name for t in g.initializer}
    inputs = {i.name: i for i in g.input if i.name not in init_names}
    dtypes = {n: onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type) for n, i in inputs.items()}
    wanted = list(wanted)
    fetch = list(dict.fromkeys(x for x, _ in wanted if x not in inputs))
    result: dict[tuple[str, int], np.ndarray] = {}

    def update(name: str, arr: np.ndarray) -> None:
        a = np.abs(np.nan_to_num(np.asarray(arr, dtype=np.float64), posinf=0.0, neginf=0.0))
        for x, axis in wanted:
            if x != name or a.ndim < -axis:
                continue
            m = np.moveaxis(a, axis, 0).reshape(a.shape[axis], -1).max(axis=1, initial=0.0)
            prev = result.get((x, axis))
            result[(x, axis)] = m if prev is None or prev.shape != m.shape else np.maximum(prev, m)

    done = 0
    with _session(model, fetch) as session:
        for sample in samples:  # not enumerate(): its reused tuple would keep the last sample alive
            done += 1
            feed = _make_feed(sample, inputs, dtypes, done)
            for name in {x for x, _ in wanted} & feed.keys():
                update(name, feed[name])
            outputs = session.run(fetch, feed) if fetch else []
            del feed, sample
            for k, name in enumerate(fetch):
                update(name, outputs[k])
                outputs[k] = None
            del outputs
    if done == 0:
        raise PulsarError("smooth quant: the calibration data yielded no samples; check "
                          "quant.input_configs[].calibration_dataset and calibration_size")
    return result


def _outlier_ratio(m: np.ndarray) -> float:
    top, median = float(m.max(initial=0.0)), float(np.median(m)) if m.size else 0.0
    if top <= 0.0:
        return 1.0
    return top / median if median > 0.0 else float("inf")


def _scales(act: np.ndarray, weight: np.ndarray, alpha: float) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        s = act**alpha / weight ** (1.0 - alpha)
    s = np.where((act > 0) & (weight > 0) & np.isfinite(s), s, 1.0)
    return np.clip(s, *SCALE_RANGE)


# ---------------------------------------------------------------------------------- entry point
def apply_smooth_quant(model: onnx.ModelProto, samples: Iterable[dict[str, np.ndarray]], *,
                       alpha: float = 0.6, threshold: float = 0.2, insert_mul: bool = True
                       ) -> tuple[onnx.ModelProto, list[SmoothReport]]:
    """Smoothed copy of ``model`` (exact in float) and one report per candidate linear layer, in
    graph order.

    ``samples`` (dicts input name -> array, e.g. the calibration data) are streamed once through
    onnxruntime; only per-channel maxima are kept. See the module docstring for the rule.
    """
    if not 0.0 <= alpha <= 1.0:
        raise PulsarError(f"quant.smooth_quant_strength: {alpha} is outside 0..1; use e.g. 0.5")
    if not 0.0 <= threshold <= 1.0:
        raise PulsarError(f"quant.smooth_quant_threshold: {threshold} is outside 0..1; use e.g. 0.2")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    gv = _Graph(out)
    groups: dict[tuple[str, int], list[_Linear]] = {}
    for node in gv.g.node:
        fn = _LINEARS.get(node.op_type) if node.domain in DEFAULT_DOMAINS else None
        lin = fn(gv, node) if fn and node.input and node.input[0] not in gv.inits else None
        if lin is not None:
            groups.setdefault((node.input[0], lin.x_axis), []).append(lin)
    if not groups:
        log.info("smooth quant: no MatMul / Gemm / 1x1 Conv with a constant weight; nothing to smooth")
        return out, []
    stats = _channel_absmax(out, groups, samples)
    order = {id(n): k for k, n in enumerate(gv.g.node)}
    reports: list[tuple[int, SmoothReport]] = []
    # Last layers first: a producer that is a smoothed layer itself has then already taken the 1/s
    # of the layers after it when the row maxima of its own weight are read.
    for (x, axis), lins in sorted(groups.items(), key=lambda kv: -order[id(kv[1][0].node)]):
        act = stats.get((x, axis))
        for lin in lins:
            if act is None or act.size != lin.channels:  # e.g. broadcasting MatMul: no channel axis
                reports.append((order[id(lin.node)], _report(lin, x, 1.0, False, 1.0, "")))
        lins = [lin for lin in lins if act is not None and act.size == lin.channels]
        if not lins:
            continue
        ratio = _outlier_ratio(act)
        smooth = threshold > 0.0 and ratio >= 1.0 / threshold and float(act.max()) > 0.0
        target, s = "", np.ones(act.size)
        if smooth:
            s = _scales(act, np.max([_weight_absmax(gv, lin) for lin in lins], axis=0), alpha)
            layers = [lin.node for lin in lins]
            plan = _absorb_plan(gv, x, axis, s.size, layers)
            if plan is not None:
                edits, target = plan
                for edit in edits:
                    edit(s)
            elif insert_mul:
                target = _insert_mul(gv, x, axis, s, layers)
            else:
                smooth, s = False, np.ones_like(s)
            for lin in lins if smooth else []:
                _scale_weight(gv, lin, s)
        reports.extend((order[id(lin.node)], _report(lin, x, ratio, smooth, float(s.max()), target))
                       for lin in lins)
    gv.place_pending()
    result = [r for _, r in sorted(reports, key=lambda kr: kr[0])]
    done = [r for r in result if r.smoothed]
    log.info("smooth quant: %d of %d linear layers smoothed (alpha %.2f, outlier ratio >= %s)",
             len(done), len(result), alpha, f"{1 / threshold:.3g}" if threshold > 0 else "inf")
    for r in done:
        log.debug("smooth quant: %s reads %s, outlier ratio %.1f, max s %.3g, 1/s into %s",
                  r.layer, r.input, r.outlier_ratio, r.max_scale, r.absorbed_into)
    return out, result


def _report(lin: _Linear, x: str, ratio: float, smoothed: bool, max_scale: float, target: str) -> SmoothReport:
    return SmoothReport(lin.node.name, lin.node.op_type, x, ratio, smoothed, max_scale, target)
