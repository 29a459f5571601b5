"""The highest default-domain opset at which the installed onnxruntime runs pulsar's Q/DQ nodes.

The quantizer writes standard QuantizeLinear / DequantizeLinear nodes at the model's own opset
(8-bit in the default domain, 16-bit as onnxruntime's ``com.microsoft`` ops, see
``pulsar/quant/qdq.py``). onnx can be newer than onnxruntime: a model at an opset whose Q/DQ
schemas onnxruntime has no kernel for (QuantizeLinear-28 in onnxruntime 1.32) builds, but its
quantized CPU subgraphs cannot be loaded at run time. The loader asks this module for the limit
and converts such models down to it. The answer is found by trying, once per process: a tiny
model holding the Q/DQ pairs pulsar writes is loaded at each opset from the newest onnx knows
down, and the first that loads is the limit.
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

log = logging.getLogger(__name__)

# QuantizeLinear / DequantizeLinear exist from opset 10 on.
MIN_QDQ_OPSET = 10
WIDE_DOMAIN = "com.microsoft"  # onnxruntime's 16-bit Q/DQ (pulsar.quant.qdq.WIDE_DOMAIN)

# (integer type, domain, axis or None, with QuantizeLinear): what pulsar.quant.qdq writes.
_PAIRS: tuple[tuple[type, str, int | None, bool], ...] = (
    (np.uint8, "", None, True),            # U8 activations
    (np.int8, "", None, True),             # S8 activations / constants
    (np.int8, "", 0, False),               # S8 weights, per channel (DequantizeLinear only)
    (np.int32, "", 0, False),              # S32 biases, per channel (DequantizeLinear only)
    (np.uint16, WIDE_DOMAIN, None, True),  # U16 activations
    (np.int16, WIDE_DOMAIN, None, True),   # S16 activations
)


def qdq_probe_model(opset: int) -> onnx.ModelProto:
    """A model at default-domain ``opset`` with one Q/DQ pair (or weight DQ) per kind pulsar writes."""
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    outputs: list[onnx.ValueInfoProto] = []
    for k, (np_type, domain, axis, quantize) in enumerate(_PAIRS):
        shape = [2] if axis is None else [2, 3]
        scale = np.full(shape[:1], 0.5, np.float32) if axis is not None else np.asarray(0.5, np.float32)
        zero: np.ndarray = np.zeros(scale.shape, np_type)
        inits += [numpy_helper.from_array(scale, f"s{k}"), numpy_helper.from_array(zero, f"z{k}")]
        pair: list[onnx.NodeProto] = []
        if quantize:
            pair.append(helper.make_node("QuantizeLinear", ["x", f"s{k}", f"z{k}"], [f"q{k}"], domain=domain))
        else:
            inits.append(numpy_helper.from_array(np.ones(shape, np_type), f"q{k}"))
        pair.append(helper.make_node("DequantizeLinear", [f"q{k}", f"s{k}", f"z{k}"], [f"y{k}"], domain=domain))
        if axis is not None:
            for node in pair:
                node.attribute.append(helper.make_attribute("axis", axis))
        nodes += pair
        outputs.append(helper.make_tensor_value_info(f"y{k}", TensorProto.FLOAT, shape))
    graph = helper.make_graph(nodes, "qdq_probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              outputs, inits)
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid(WIDE_DOMAIN, 1)]
    ir_version = helper.find_min_ir_version_for(opsets[:1], ignore_unknown=True)
    return helper.make_model(graph, opset_imports=opsets, ir_version=ir_version)


def ort_loads_qdq(opset: int) -> bool:
    """Whether onnxruntime creates a session for :func:`qdq_probe_model` at ``opset``."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4  # the refusals are expected; keep them off the console
    try:
        ort.InferenceSession(qdq_probe_model(opset).SerializeToString(), options,
                             providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own exception types for a missing kernel
        log.debug("onnxruntime cannot load Q/DQ at opset %d: %s", opset, str(exc).splitlines()[0] if str(exc) else exc)
        return False
    return True


@functools.cache
def max_qdq_opset() -> int | None:
    """The highest default-domain opset (up to onnx's newest) at which onnxruntime loads pulsar's
    Q/DQ nodes; None when it loads them at none (then no opset is better than another)."""
    for opset in range(onnx.defs.onnx_opset_version(), MIN_QDQ_OPSET - 1, -1):
        if ort_loads_qdq(opset):
            log.debug("onnxruntime loads Q/DQ up to opset %d", opset)
            return opset
    log.debug("onnxruntime loads pulsar's Q/DQ nodes at no opset from %d up", MIN_QDQ_OPSET)
    return None
