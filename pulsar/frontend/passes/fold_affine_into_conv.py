"""Fold a constant per-channel Mul / Add after a Conv, ConvTranspose or Gemm into its weights.

Paddle exports (PP-OCR among them) spell a folded BatchNorm or a learnable scale as Conv -> Mul ->
Add with per-channel or scalar constants. Both are affine in the layer's output channels:
(conv(x, W) + b) * s + t == conv(x, W * s) + (b * s + t), so they belong in the weights and bias,
where the NPU applies them for free instead of running (and requantizing) two elementwise layers.
Only a scale / shift that is the same across every axis but the channel axis folds; a Mul or Add
*before* a convolution does not in general (the zero padding is not shifted), so it is left alone.
The arithmetic runs in float64 and is cast back to the weight dtype.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

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
from pulsar.frontend.passes.fold_batchnorm import scale_conv, scale_conv_transpose
from pulsar.frontend.passes.registry import register_pass

log = logging.getLogger(__name__)

_FLOAT_TYPES = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16}


@dataclass
class _Layer:
    """A Conv / ConvTranspose / Gemm in the form every fold needs: weight, bias, channel count."""

    node: onnx.NodeProto
    weight: np.ndarray
    bias: np.ndarray | None
    channels: int
    out_rank: int


def _conv_channels(node: onnx.NodeProto, w: np.ndarray) -> int:
    if node.op_type == "ConvTranspose":
        return w.shape[1] * int(attr(node, "group", 1))
    return w.shape[0]


def _scale_gemm(node: onnx.NodeProto, w: np.ndarray, s: np.ndarray) -> np.ndarray:
    return w * s[:, None] if attr(node, "transB", 0) else w * s[None, :]


# op_type -> (weight, per-channel scale) -> scaled weight
_SCALE_WEIGHT: dict[str, Callable[[onnx.NodeProto, np.ndarray, np.ndarray], np.ndarray]] = {
    "Conv": lambda node, w, s: scale_conv(w, s, int(attr(node, "group", 1))),
    "ConvTranspose": lambda node, w, s: scale_conv_transpose(w, s, int(attr(node, "group", 1))),
    "Gemm": _scale_gemm,
}


def _layer(node: onnx.NodeProto, inits: dict, constant: set[str]) -> _Layer | None:
    if node.op_type not in _SCALE_WEIGHT or node.domain not in DEFAULT_DOMAINS or len(node.input) < 2:
        return None
    if node.input[1] not in constant or (
        len(node.input) > 2 and node.input[2] and node.input[2] not in constant
    ):
        return None
    proto = inits[node.input[1]]
    if proto.data_type not in _FLOAT_TYPES:
        return None
    w = numpy_helper.to_array(proto)
    has_bias = len(node.input) > 2 and bool(node.input[2])
    bias = numpy_helper.to_array(inits[node.input[2]]) if has_bias else None
    if node.op_type == "Gemm":
        if w.ndim != 2:
            return None
        channels = w.shape[0] if attr(node, "transB", 0) else w.shape[1]
        return _Layer(node, w, bias, channels, 2)
    if w.ndim < 3:
        return None
    return _Layer(node, w, bias, _conv_channels(node, w), w.ndim)


def _per_channel(c: np.ndarray, layer: _Layer) -> np.ndarray | None:
    """``c`` as a [channels] vector if it broadcasts onto the output along the channel axis only."""
    if c.ndim > layer.out_rank:
        return None  # would add axes to the output
    dims = [1] * (layer.out_rank - c.ndim) + list(c.shape)
    if any(d != 1 for axis, d in enumerate(dims) if axis != 1) or dims[1] not in (1, layer.channels):
        return None
    return np.broadcast_to(c.astype(np.float64).reshape(-1), (layer.channels,))


def _folded(layer: _Layer, op_type: str, v: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None, dict]:
    """New (weight, bias, attributes) of ``layer`` followed by ``op_type`` with vector ``v``;
    None for a tensor that stays as it is."""
    node, w = layer.node, layer.weight.astype(np.float64)
    bias = None if layer.bias is None else layer.bias.astype(np.float64)
    if op_type == "Mul":
        return _SCALE_WEIGHT[node.op_type](node, w, v), None if bias is None else bias * v, {}
    shift = v if op_type == "Add" else -v
    if node.op_type == "Gemm":
        beta = float(attr(node, "beta", 1.0))
        new_c = shift if bias is None else beta * bias + shift  # bias may be [M, N], [1, N], [N], []
        return None, new_c, ({"beta": 1.0} if beta != 1.0 else {})
    return None, (shift if bias is None else bias + shift), {}


def _store(graph, inits, readers, owner, name: str | None, value: np.ndarray, base: str, taken) -> str:
    """Overwrite ``name`` if only ``owner`` reads it, else add ``value`` under a fresh name."""
    if name and name in inits and len(readers.get(name, [])) == 1:
        inits[name].CopyFrom(numpy_helper.from_array(value, name))
        return name
    new = unique_name(base, taken)
    graph.initializer.append(numpy_helper.from_array(value, new))
    inits[new] = graph.initializer[-1]
    readers[new] = [owner]
    return new


def _apply(graph, layer: _Layer, op_type: str, v: np.ndarray, inits, readers, taken) -> None:
    node = layer.node
    dtype = layer.weight.dtype
    weight, bias, attrs = _folded(layer, op_type, v)
    if weight is not None:
        base = f"{node.input[1]}_folded"
        node.input[1] = _store(graph, inits, readers, node, node.input[1], weight.astype(dtype), base, taken)
    if bias is not None:
        while len(node.input) < 3:
            node.input.append("")
        old = node.input[2] or None
        base = f"{old}_folded" if old else f"{node.name or node.output[0]}_bias"
        node.input[2] = _store(graph, inits, readers, node, old, np.asarray(bias).astype(dtype), base, taken)
    if attrs:
        kept = [a for a in node.attribute if a.name not in attrs]
        del node.attribute[:]
        node.attribute.extend([*kept, *(helper.make_attribute(k, v) for k, v in attrs.items())])


@register_pass("fold_affine_into_conv")
def fold_affine_into_conv(model: onnx.ModelProto) -> bool:
    graph = model.graph
    inits = initializers(graph)
    constant = set(inits) - overridable_initializers(model)
    readers = consumers(graph)
    made = producers(graph)
    outputs = output_names(graph)
    taken = tensor_names(graph)
    folded = []
    for op in graph.node:
        if op.op_type not in ("Mul", "Add", "Sub") or op.domain not in DEFAULT_DOMAINS or len(op.input) != 2:
            continue
        sides = (0,) if op.op_type == "Sub" else (0, 1)  # c - conv(x) would negate the weights too
        for i in sides:
            layer_node, c_name = made.get(op.input[i]), op.input[1 - i]
            if layer_node is not None and c_name in constant and op.input[i] != c_name:
                break
        else:
            continue
        out = layer_node.output[0]
        if out in outputs or len(readers.get(out, [])) != 1:
            continue  # the layer's own output is needed elsewhere
        layer = _layer(layer_node, inits, constant)
        if layer is None or inits[c_name].data_type != inits[layer_node.input[1]].data_type:
            continue
        v = _per_channel(numpy_helper.to_array(inits[c_name]), layer)
        if v is None:
            continue
        _apply(graph, layer, op.op_type, v, inits, readers, taken)
        drop_value_info(graph, [out])
        layer_node.output[0] = op.output[0]
        made[op.output[0]] = layer_node
        folded.append(op)
    if folded:
        log.debug("folded %d constant Mul / Add / Sub nodes into convolution weights", len(folded))
    return remove_nodes(graph, folded) > 0
