"""Fold inference BatchNormalization into the preceding Conv / ConvTranspose.

BN after a convolution is a per-output-channel affine map, so it can live in the conv's weights and
bias: y = (conv(x, W) + b - mean) * s + beta with s = gamma / sqrt(var + eps) equals
conv(x, W * s) + (b - mean) * s + beta. This removes a layer the NPU would otherwise run (and
quantize) separately. The arithmetic runs in float64 and is cast back to the weight dtype.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import numpy_helper

from pulsar.frontend.graph import (
    DEFAULT_DOMAINS,
    attr,
    consumers,
    drop_value_info,
    initializers,
    output_names,
    overridable_initializers,
    producers,
    remove_nodes,
    tensor_names,
    unique_name,
)
from pulsar.frontend.passes.registry import register_pass

log = logging.getLogger(__name__)


def scale_conv(w: np.ndarray, s: np.ndarray, group: int) -> np.ndarray:
    # Conv weight is [M, C/g, k...]: output channels are axis 0 whatever the grouping.
    return w * s.reshape(-1, *([1] * (w.ndim - 1)))


def scale_conv_transpose(w: np.ndarray, s: np.ndarray, group: int) -> np.ndarray:
    # ConvTranspose weight is [C, M/g, k...]; output channel of (group j, column m) is j * M/g + m.
    c, m_per_group, *kernel = w.shape
    grouped = w.reshape(group, c // group, m_per_group, *kernel)
    scale = s.reshape(group, 1, m_per_group, *([1] * len(kernel)))
    return (grouped * scale).reshape(w.shape)


_SCALERS = {"Conv": scale_conv, "ConvTranspose": scale_conv_transpose}


def _bn_params(
    bn: onnx.NodeProto, inits: dict[str, onnx.TensorProto]
) -> tuple[np.ndarray, np.ndarray] | None:
    """(scale, shift) of an inference-mode BN whose parameters are all initializers, else None."""
    if attr(bn, "training_mode", 0) or any(o for o in bn.output[1:]):
        return None
    if len(bn.input) < 5 or not all(name in inits for name in bn.input[1:5]):
        return None
    gamma, beta, mean, var = (numpy_helper.to_array(inits[n]).astype(np.float64) for n in bn.input[1:5])
    scale = gamma / np.sqrt(var + float(attr(bn, "epsilon", 1e-5)))
    return scale, beta - mean * scale


def _write(graph, inits, readers, name: str, value: np.ndarray, taken: set[str]) -> str:
    """Store ``value`` under ``name`` if only this conv reads it, else under a fresh name (shared weights)."""
    if name in inits and len(readers.get(name, [])) == 1:
        inits[name].CopyFrom(numpy_helper.from_array(value, name))
        return name
    new = unique_name(f"{name}_bn_folded", taken)
    graph.initializer.append(numpy_helper.from_array(value, new))
    return new


@register_pass("fold_batchnorm")
def fold_batchnorm(model: onnx.ModelProto) -> bool:
    graph = model.graph
    inits = initializers(graph)
    readers = consumers(graph)
    made = producers(graph)
    outputs = output_names(graph)
    taken = tensor_names(graph)
    overridable = overridable_initializers(model)
    folded = []
    for bn in graph.node:
        if bn.op_type != "BatchNormalization" or bn.domain not in DEFAULT_DOMAINS:
            continue
        conv = made.get(bn.input[0])
        if conv is None or conv.op_type not in _SCALERS or conv.domain not in DEFAULT_DOMAINS:
            continue
        if conv.output[0] in outputs or len(readers.get(conv.output[0], [])) != 1:
            continue  # the un-normalized conv output is needed elsewhere
        if len(conv.input) < 2 or conv.input[1] not in inits or overridable & set(conv.input[1:]):
            continue
        params = _bn_params(bn, inits)
        if params is None:
            continue
        scale, shift = params
        w_proto = inits[conv.input[1]]
        w = numpy_helper.to_array(w_proto)
        group = int(attr(conv, "group", 1))
        if conv.op_type == "Conv" and w.shape[0] != scale.size:
            continue
        if conv.op_type == "ConvTranspose" and w.shape[1] * group != scale.size:
            continue
        has_bias = len(conv.input) > 2 and conv.input[2]
        if has_bias and conv.input[2] not in inits:
            continue
        bias = numpy_helper.to_array(inits[conv.input[2]]).astype(np.float64) if has_bias else 0.0
        new_w = _SCALERS[conv.op_type](w.astype(np.float64), scale, group).astype(w.dtype)
        new_b = (bias * scale + shift).astype(w.dtype)
        conv.input[1] = _write(graph, inits, readers, conv.input[1], new_w, taken)
        if has_bias:
            conv.input[2] = _write(graph, inits, readers, conv.input[2], new_b, taken)
        else:
            bias_name = unique_name(f"{conv.name or conv.output[0]}_bias", taken)
            graph.initializer.append(numpy_helper.from_array(new_b, bias_name))
            while len(conv.input) < 3:
                conv.input.append("")
            conv.input[2] = bias_name
        drop_value_info(graph, [conv.output[0]])
        conv.output[0] = bn.output[0]
        folded.append(bn)
    if folded:
        log.debug("folded %d BatchNormalization nodes into convolutions", len(folded))
    return remove_nodes(graph, folded) > 0
