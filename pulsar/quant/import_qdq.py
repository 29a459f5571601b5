"""``model_type: QuantONNX``: take a QDQ ONNX model (from QAT or another quantizer) apart.

The QuantizeLinear / DequantizeLinear pairs are removed, giving the float graph pulsar works on,
and their parameters are kept as :class:`TensorQuant` objects so the export reuses them: the
imported scales win; only tensors the imported model left float get calibrated ranges.
"""

from __future__ import annotations

import logging

import ml_dtypes
import numpy as np
import onnx
from onnx import numpy_helper

from pulsar.errors import PulsarError
from pulsar.quant.scheme import DTYPES, TensorQuant

log = logging.getLogger(__name__)

_DTYPE_NAMES = {np.dtype(np.uint8): "U8", np.dtype(np.int8): "S8", np.dtype(np.uint16): "U16",
                np.dtype(np.int16): "S16", np.dtype(np.int32): "S32",
                np.dtype(ml_dtypes.int4): "S4", np.dtype(ml_dtypes.uint4): "U4"}


def _attr_axis(node: onnx.NodeProto) -> int:
    return next((int(a.i) for a in node.attribute if a.name == "axis"), 1)


def _params(node: onnx.NodeProto, inits: dict[str, np.ndarray], name: str, kind: str,
            ndim: int | None, stored: np.dtype | None = None) -> TensorQuant:
    """The grid of one DequantizeLinear; ``stored`` is the integer type of its input when that is a
    constant (the type when the zero point is left out; uint8 for a QuantizeLinear's output)."""
    block = next((int(a.i) for a in node.attribute if a.name == "block_size"), 0)
    if block:
        raise PulsarError(f"QuantONNX input: tensor {name!r} is quantized in blocks of {block} (block_size); "
                          "pulsar imports per-tensor and per-channel grids only: export the model per channel")
    scale = inits.get(node.input[1])
    if scale is None:
        raise PulsarError(f"QuantONNX input: {node.op_type} {node.name!r} has a non-constant scale; "
                          "only constant scales and zero points can be imported")
    zp = inits[node.input[2]] if len(node.input) > 2 and node.input[2] else \
        np.zeros(scale.shape, dtype=stored if stored is not None else np.uint8)
    dtype = _DTYPE_NAMES.get(zp.dtype)
    if dtype is None:
        raise PulsarError(f"QuantONNX input: tensor {name!r} uses {zp.dtype}, which pulsar does not import "
                          "(U4, S4, U8, S8, U16, S16, S32)")
    zp = zp.astype(DTYPES[dtype][3])  # 4-bit zero points are computed in 8-bit arrays
    axis = None
    if scale.size > 1:
        axis = _attr_axis(node)
        if ndim is not None and axis < 0:
            axis += ndim
    symmetric = bool(np.all(zp == 0)) and dtype.startswith("S")
    return TensorQuant(name, dtype, scale.astype(np.float32), zp, axis=axis, symmetric=symmetric, kind=kind,
                       state="ACTIVATED", extra={"imported": True})


def strip_qdq(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, TensorQuant]]:
    """Return the float model and the imported per-tensor quantization (by float tensor name)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    inits = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    graph_outputs = {o.name for o in g.output}
    imported: dict[str, TensorQuant] = {}
    drop: list[onnx.NodeProto] = []
    rename: dict[str, str] = {}
    new_inits: list[onnx.TensorProto] = []
    for node in g.node:
        if node.op_type != "DequantizeLinear":
            continue
        src = node.input[0]
        if src in inits:  # a constant (weight, bias): store it dequantized, keep its grid
            q = inits[src]
            tq = _params(node, inits, node.output[0], "weight", q.ndim, q.dtype)
            shape = [1] * q.ndim
            if tq.axis is not None:
                shape[tq.axis] = -1
            real = (q.astype(np.float64) - np.asarray(tq.zero_point, np.float64).reshape(shape if tq.axis is not None
                                                                                        else ())) \
                * np.asarray(tq.scale, np.float64).reshape(shape if tq.axis is not None else ())
            new_inits.append(numpy_helper.from_array(real.astype(np.float32), node.output[0]))
            tq.kind = "bias" if tq.dtype == "S32" else "weight"
            imported[node.output[0]] = tq
            drop.append(node)
            continue
        qnode = producer.get(src)
        if qnode is None or qnode.op_type != "QuantizeLinear":
            raise PulsarError(f"QuantONNX input: DequantizeLinear {node.name!r} reads {src!r}, which is neither a "
                              "constant nor a QuantizeLinear output")
        x, y = qnode.input[0], node.output[0]
        tq = _params(node, inits, x, "activation", None)
        drop += [qnode, node]
        # Keep the name users know: a graph output's, or the DQ output of pulsar's own "T/float" ->
        # "T" naming; otherwise the quantized tensor's own name (onnxruntime's DQ outputs are
        # "<x>_DequantizeLinear_Output").
        if y in graph_outputs or x.endswith("/float"):  # the producer of x now writes y
            rename[x] = y
            tq.name = y
            imported[y] = tq
        else:
            rename[y] = x
            imported[x] = tq
    dropped = {id(n) for n in drop}
    kept = [n for n in g.node if id(n) not in dropped]
    # x -> y (producer renamed) or y -> x (readers renamed): either way every use follows the map.
    for n in kept:
        for i, name in enumerate(n.input):
            if name in rename:
                n.input[i] = rename[name]
        for i, name in enumerate(n.output):
            if name in rename:
                n.output[i] = rename[name]
    del g.node[:]
    g.node.extend(kept)
    used = {i for n in kept for i in n.input}
    survivors = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(survivors + [t for t in new_inits if t.name in used])
    del g.value_info[:]
    for opset in out.opset_import:
        if opset.domain == "com.microsoft" and not any(n.domain == "com.microsoft" for n in kept):
            out.opset_import.remove(opset)
            break
    log.info("QuantONNX input: %d Q/DQ pairs and %d quantized constants imported",
             sum(1 for t in imported.values() if t.kind == "activation"),
             sum(1 for t in imported.values() if t.kind != "activation"))
    if not imported:
        raise PulsarError("QuantONNX input: the model has no QuantizeLinear / DequantizeLinear nodes; "
                          "use model_type ONNX for a float model")
    return out, imported
