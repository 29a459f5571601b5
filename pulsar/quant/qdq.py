"""Write the QDQ ONNX model: standard QuantizeLinear / DequantizeLinear pairs that onnxruntime runs.

Naming keeps the float graph's tensor names meaningful: a quantized activation ``T`` is produced
as ``T/float`` by its op, quantized to ``T/q`` and dequantized back into ``T``; so consumers, graph
outputs and the per-tensor JSON all use the original name. Weights become ``W/q`` (int8)
dequantized into ``W``.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import onnx
from onnx import helper, numpy_helper, version_converter

from pulsar.core.dtypes import DATA_TYPES
from pulsar.core.float_ops import FLOAT_FORMATS, float_format
from pulsar.errors import PulsarError
from pulsar.quant.plan import QuantPlan

if TYPE_CHECKING:
    from pulsar.quant.layer_tuning import LayerTuning
from pulsar.quant.scheme import (
    BITS,
    TensorQuant,
    activation_quant,
    bias_fits_s32,
    bias_quant,
    float_grid,
    requantize,
    weight_quant,
    weight_quant_blocked,
)

log = logging.getLogger(__name__)

FLOAT = onnx.TensorProto.FLOAT


def _init(g: onnx.GraphProto, name: str, arr: np.ndarray) -> None:
    g.initializer.append(numpy_helper.from_array(np.asarray(arr), name))


# opset 17's QuantizeLinear / DequantizeLinear take 8-bit types only; onnxruntime's contrib ops of the
# same name take 16-bit ones too (the standard ops gain them in opset 21).
WIDE_DOMAIN = "com.microsoft"


def _qdq_domain(tq: TensorQuant) -> str:
    # 4-bit types enter the standard DequantizeLinear only at opset 21, like 16-bit ones; blocked grids
    # exist only there (the model is then written at opset 21)
    if tq.block_size:
        return ""
    return WIDE_DOMAIN if BITS[tq.dtype] in (4, 16) else ""


# 4-bit integers: computed in int8 / uint8 arrays, stored as onnx INT4 / UINT4 (two per byte)
_PACKED = {n: helper.tensor_dtype_to_np_dtype(t.onnx_type) for n, t in DATA_TYPES.items() if t.packed}
# the first IR version with INT4 / UINT4 tensors
INT4_IR_VERSION = 10
# the first opset whose DequantizeLinear takes blocks (block_size)
BLOCKED_OPSET = 21


def stored(tq: TensorQuant, q: np.ndarray) -> np.ndarray:
    """The integers ``q`` of ``tq``'s grid in the element type the QDQ model stores them in."""
    packed = _PACKED.get(tq.dtype)
    return np.asarray(q, dtype=tq.np_dtype).astype(packed) if packed is not None else np.asarray(q)


def _qdq_nodes(g: onnx.GraphProto, src: str, dst: str, tq: TensorQuant, *, quantize: bool = True) -> None:
    """src (float) -> QuantizeLinear -> DequantizeLinear -> dst; weights skip the Q (already int)."""
    domain = _qdq_domain(tq)
    _init(g, f"{tq.name}/scale", np.asarray(tq.scale, dtype=np.float32))
    _init(g, f"{tq.name}/zero_point", stored(tq, np.asarray(tq.zero_point, dtype=tq.np_dtype)))
    axis = [helper.make_attribute("axis", tq.axis)] if tq.axis is not None else []
    if tq.block_size:
        axis.append(helper.make_attribute("block_size", tq.block_size))
    q_out = f"{tq.name}/q"
    if quantize:
        qn = helper.make_node("QuantizeLinear", [src, f"{tq.name}/scale", f"{tq.name}/zero_point"], [q_out],
                              name=f"{tq.name}/QuantizeLinear", domain=domain)
        qn.attribute.extend(axis)
        g.node.append(qn)
    dq = helper.make_node("DequantizeLinear", [q_out if quantize else src, f"{tq.name}/scale",
                                               f"{tq.name}/zero_point"], [dst], name=f"{tq.name}/DequantizeLinear",
                          domain=domain)
    dq.attribute.extend(axis)
    g.node.append(dq)


# U32 (quant.ln_scale_data_type): no DequantizeLinear takes uint32 codes (onnxruntime's int32 one
# computes q - zero point in int32, which 2**32 codes overflow), so they are widened instead:
# codes -> Cast(DOUBLE) -> Sub(zero point) -> Mul(scale) -> Cast(FLOAT): exact in float64, rounded
# once to float32 as a DequantizeLinear rounds. The lowering folds the chain back into the constant
# (pulsar/compiler/lower/qdq_graph.py).
WIDENED = ("U32",)


def _widened_dq(g: onnx.GraphProto, src: str, dst: str, tq: TensorQuant, rank: int) -> None:
    shape = [-1] + [1] * (rank - 1 - tq.axis) if tq.axis is not None else []
    _init(g, f"{tq.name}/scale", np.asarray(tq.scale, dtype=np.float64).reshape(shape))
    _init(g, f"{tq.name}/zero_point", np.asarray(tq.zero_point, dtype=np.float64).reshape(shape))
    g.node.extend([
        helper.make_node("Cast", [src], [f"{src}/f64"], name=f"{tq.name}/Widen", to=onnx.TensorProto.DOUBLE),
        helper.make_node("Sub", [f"{src}/f64", f"{tq.name}/zero_point"], [f"{src}/centered"], name=f"{tq.name}/Center"),
        helper.make_node("Mul", [f"{src}/centered", f"{tq.name}/scale"], [f"{src}/real"], name=f"{tq.name}/Scale"),
        helper.make_node("Cast", [f"{src}/real"], [dst], name=f"{tq.name}/ToFloat", to=FLOAT),
    ])


def constant_quant(name: str, arr: np.ndarray, refine_threshold: float,
                   dtype: str = "S8") -> tuple[TensorQuant, np.ndarray]:
    """Constant operands of element-wise ops (LayerNorm gamma / beta, scales): S8 symmetric, per
    channel when the constant varies along a single axis (a per-channel vector broadcast over the
    rest), so a small channel is not rounded to zero by a large one."""
    varying = [i for i, d in enumerate(arr.shape) if d > 1]
    if len(varying) == 1:
        tq, q = weight_quant(name, arr, varying[0], dtype, refine_threshold=refine_threshold)
    else:
        tq, q = weight_quant(name, arr.reshape(1, -1), 0, dtype, refine_threshold=refine_threshold)
        tq.axis, tq.scale, tq.zero_point = None, tq.scale.reshape(()), tq.zero_point.reshape(())
        q = q.reshape(arr.shape)
    tq.kind = "constant"
    return tq, q


def topological_sort(g: onnx.GraphProto) -> None:
    """Reorder nodes so every input is produced before use (new Q/DQ nodes were appended)."""
    produced = {i.name for i in g.input} | {t.name for t in g.initializer} | {""}
    nodes = list(g.node)
    waiting: dict[str, list[int]] = defaultdict(list)
    missing = []
    for idx, n in enumerate(nodes):
        need = {i for i in n.input if i not in produced}
        missing.append(need)
        for i in need:
            waiting[i].append(idx)
    # Kahn's algorithm over tensor availability; outer-scope names (subgraphs) are treated as ready.
    producers = {o for n in nodes for o in n.output}
    for need in missing:
        for i in list(need):
            if i not in producers:
                need.discard(i)
    ready = [i for i, need in enumerate(missing) if not need]
    order: list[int] = []
    while ready:
        idx = ready.pop(0)
        order.append(idx)
        for o in nodes[idx].output:
            for j in waiting.pop(o, []):
                missing[j].discard(o)
                if not missing[j]:
                    ready.append(j)
    if len(order) != len(nodes):
        raise RuntimeError("graph has a cycle; cannot order the quantized graph")
    del g.node[:]
    g.node.extend(nodes[i] for i in order)


def quant_params(model: onnx.ModelProto, plan: QuantPlan, ranges: dict[str, tuple[float, float]], *,
                 bias_fp32: bool = False, fixed: dict[str, TensorQuant] | None = None,
                 refine_weight_threshold: float = 1e-6,
                 tuning: Mapping[str, LayerTuning] | None = None) -> dict[str, TensorQuant]:
    """The quantization parameters of every quantized tensor of ``plan``, in export order (weights,
    constants, activations, biases). ``tuning`` (per node, :mod:`pulsar.quant.layer_tuning`) gives a
    layer's weight calibration method and bias bits.

    ``fixed`` holds parameters that must be kept (a QuantONNX input's own scales, or the scales an
    algorithm learned): those tensors keep their given grid instead of a calibrated one. A bias is
    always derived from its input's and weight's scales (unless fixed), so it follows a changed scale."""
    fixed = fixed or {}
    inits = {t.name: t for t in model.graph.initializer}
    params: dict[str, TensorQuant] = {}
    for w in plan.weights:
        if w.tensor in fixed:
            params[w.tensor] = fixed[w.tensor]
        else:
            arr = numpy_helper.to_array(inits[w.tensor])
            if w.group:
                params[w.tensor] = weight_quant_blocked(w.tensor, arr, w.group_axis, w.group, w.dtype,
                                                        refine_weight_threshold)[0]
                continue
            cal = tuning[w.node].weights if tuning and w.node in tuning else None
            params[w.tensor] = weight_quant(w.tensor, arr, None if w.per_tensor else w.axis, w.dtype,
                                            refine_threshold=refine_weight_threshold,
                                            **({"method": cal.method, "method_params": cal.kwargs()} if cal else {}))[0]
    for name in plan.constants:
        if name in fixed:
            params[name] = fixed[name]
        else:
            arr = numpy_helper.to_array(inits[name])
            params[name] = constant_quant(name, arr, refine_weight_threshold, plan.dtypes.get(name, "S8"))[0]
    for name, fmt in plan.float_constants.items():
        params[name] = float_grid(name, fmt, "constant")
    for name in plan.activations:
        if float_format(plan.dtypes[name]):
            params[name] = float_grid(name, plan.dtypes[name])
            continue
        lo, hi = ranges[name]
        params[name] = fixed[name] if name in fixed else activation_quant(name, lo, hi, plan.dtypes[name],
                                                                                     plan.symmetric.get(name))
        if name in plan.shared:
            params[name].state, params[name].dominator = "OVERLAPPED", plan.dominator(name)
    for b in plan.biases:
        act, w = params.get(b.activation), params.get(b.weight)
        if bias_fp32 or act is None or w is None:
            continue
        arr = numpy_helper.to_array(inits[b.tensor])
        if not bias_fits_s32(arr, float(act.scale), w.scale):
            log.debug("bias %s kept float: it overflows int32 on the %s x %s accumulator grid", b.tensor,
                      act.dtype, w.dtype)
            continue
        bits = tuning[b.node].bias_bits if tuning and b.node in tuning else 32
        params[b.tensor] = fixed[b.tensor] if b.tensor in fixed else bias_quant(b.tensor, arr, float(act.scale),
                                                                                 w.scale, bits)[0]
    return params


def _cast_pair(g: onnx.GraphProto, src: str, dst: str, mid: str, fmt: str) -> None:
    """``src -> Cast(fmt) -> mid -> Cast(FLOAT) -> dst``: rounding to an FP16 / BF16 grid."""
    g.node.append(helper.make_node("Cast", [src], [mid], name=f"{mid}/CastTo{fmt}", to=FLOAT_FORMATS[fmt][0]))
    g.node.append(helper.make_node("Cast", [mid], [dst], name=f"{mid}/CastToFloat", to=FLOAT))


def _float_pair(g: onnx.GraphProto, name: str, tq: TensorQuant, graph_inputs: set[str],
                input_users: dict[str, list[tuple[onnx.NodeProto, int]]],
                producers: dict[str, tuple[onnx.NodeProto, int]]) -> None:
    """``src -> Cast(format) -> T/h -> Cast(FLOAT) -> dst``: the tensor rounded to an FP16 / BF16 grid."""
    if name in graph_inputs:
        src, dst = name, f"{name}/dq"
        for n, k in input_users[name]:
            n.input[k] = dst
    else:
        n, k = producers[name]
        src, dst = f"{name}/float", name
        n.output[k] = src
    _cast_pair(g, src, dst, f"{name}/h", tq.dtype)


def export_qdq(model: onnx.ModelProto, plan: QuantPlan, params: dict[str, TensorQuant]) -> onnx.ModelProto:
    """The QDQ model of ``model``: every tensor of ``params`` put on its grid (constants stored as
    integers and dequantized, activations quantized and dequantized where they are produced)."""
    qmodel = onnx.ModelProto()
    qmodel.CopyFrom(model)
    opset = next((o.version for o in qmodel.opset_import if o.domain in ("", "ai.onnx")), 0)
    if any(t.block_size for t in params.values()) and opset < BLOCKED_OPSET:
        try:
            qmodel = version_converter.convert_version(qmodel, BLOCKED_OPSET)  # blocked DequantizeLinear
        except Exception as exc:  # onnx's converter raises its own error types
            raise PulsarError(f"quant.layer_configs weight_group_size: the QDQ model must be at opset "
                              f"{BLOCKED_OPSET} for grouped weights, and onnx cannot convert this model from opset "
                              f"{opset} ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); use "
                              "per-channel weights (leave weight_group_size out)") from None
        qmodel.ir_version = max(qmodel.ir_version, INT4_IR_VERSION)
    g = qmodel.graph
    inits = {t.name: t for t in g.initializer}

    def store(name: str) -> None:
        tq = params[name]
        arr = numpy_helper.to_array(inits[name])
        g.initializer.remove(inits.pop(name))
        _init(g, f"{name}/q", stored(tq, requantize(tq, arr)))
        if tq.dtype in WIDENED:
            _widened_dq(g, f"{name}/q", name, tq, arr.ndim)
        else:
            _qdq_nodes(g, f"{name}/q", name, tq, quantize=False)

    for w in plan.weights:
        store(w.tensor)
    for name in plan.constants:
        store(name)
    for name in plan.float_constants:
        if name in inits:  # stored in its format, widened back by a Cast (the float DequantizeLinear)
            elem, np_type = FLOAT_FORMATS[params[name].dtype]
            arr = numpy_helper.to_array(inits[name])
            g.initializer.remove(inits.pop(name))
            _init(g, f"{name}/h", arr.astype(np_type))
            g.node.append(helper.make_node("Cast", [f"{name}/h"], [name], name=f"{name}/Cast", to=FLOAT))
    for b in plan.biases:
        if b.tensor in params:
            store(b.tensor)

    graph_inputs = {i.name for i in g.input}
    producers = {o: (n, k) for n in g.node for k, o in enumerate(n.output)}
    input_users: dict[str, list[tuple[onnx.NodeProto, int]]] = defaultdict(list)
    for n in g.node:
        for k, i in enumerate(n.input):
            if i in graph_inputs:
                input_users[i].append((n, k))
    for name in plan.activations:
        tq = params[name]
        if float_format(tq.dtype):
            _float_pair(g, name, tq, graph_inputs, input_users, producers)
            continue
        if name in graph_inputs:
            for n, k in input_users[name]:
                n.input[k] = f"{name}/dq"
            _qdq_nodes(g, name, f"{name}/dq", tq)
        else:
            n, k = producers[name]
            n.output[k] = f"{name}/float"
            if name in plan.float_writes:  # a float layer's output: rounded to its format, then quantized
                fmt = plan.float_writes[name]
                n.output[k] = f"{name}/{fmt}"
                _cast_pair(g, f"{name}/{fmt}", f"{name}/float", f"{name}/{fmt}/h", fmt)
            _qdq_nodes(g, f"{name}/float", name, tq)
    by_name = {n.name: n for n in g.node}
    for node_name, i, fmt in plan.float_reads:  # a float layer reading an integer grid: to its format first
        n = by_name[node_name]
        src = n.input[i]
        _cast_pair(g, src, f"{src}/{node_name}/{fmt}", f"{src}/{node_name}/{fmt}/h", fmt)
        n.input[i] = f"{src}/{node_name}/{fmt}"
    topological_sort(g)
    if any(params[w.tensor].dtype in _PACKED for w in plan.weights if w.tensor in params):
        qmodel.ir_version = max(qmodel.ir_version, INT4_IR_VERSION)
    if any(n.domain == WIDE_DOMAIN for n in g.node) and not any(o.domain == WIDE_DOMAIN for o in qmodel.opset_import):
        qmodel.opset_import.append(helper.make_opsetid(WIDE_DOMAIN, 1))
    return qmodel


def output_steps(qmodel: onnx.ModelProto) -> dict[str, float]:
    """Graph output -> the step of the 8-bit per-tensor grid it is dequantized from. Outputs on a 16-bit
    grid are left out: a slice below one of its steps spans less than 1/65535 of the tensor's range
    (a detector class that never fires), which is no grid's fault."""
    inits = {t.name: t for t in qmodel.graph.initializer}
    outputs = {o.name for o in qmodel.graph.output}
    steps = {}
    for n in qmodel.graph.node:
        if n.op_type != "DequantizeLinear" or n.output[0] not in outputs or len(n.input) < 3:
            continue
        scale, zp = inits.get(n.input[1]), inits.get(n.input[2])
        if scale is not None and zp is not None and len(scale.dims) == 0 and \
                zp.data_type in (onnx.TensorProto.UINT8, onnx.TensorProto.INT8):
            steps[n.output[0]] = float(numpy_helper.to_array(scale))
    return steps
