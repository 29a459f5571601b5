"""Merge an explicit constant Pad into the ``pads`` of the Conv / pooling node that reads it.

Paddle and TF exports often spell "same" padding as a separate Pad node. On the NPU that is an extra
copy of the whole feature map (and an extra requantization point); as the consumer's own ``pads``
it costs nothing. A Pad merges only when it is exactly what the consumer's implicit padding does:
zeros for Conv and for AveragePool counting the pad cells, -inf for MaxPool, and only on the
spatial axes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

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
)
from pulsar.frontend.passes.registry import register_pass

log = logging.getLogger(__name__)

# Consumer rule: (consumer, pad value, spatial begins, spatial ends) -> new attributes to set, or
# None when the Pad cannot merge into this consumer.
MergeRule = Callable[[onnx.NodeProto, float, list[int], list[int]], dict | None]
MERGE_RULES: dict[str, MergeRule] = {}


def _merge_rule(op_type: str) -> Callable[[MergeRule], MergeRule]:
    def decorator(fn: MergeRule) -> MergeRule:
        MERGE_RULES[op_type] = fn
        return fn

    return decorator


def _explicit_pads(node: onnx.NodeProto, spatial: int) -> list[int] | None:
    """The consumer's own pads (begins then ends), or None for SAME_* auto padding."""
    auto_pad = attr(node, "auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else str(auto_pad)
    if auto_pad not in ("NOTSET", "VALID"):
        return None  # SAME_* padding depends on the input size, which the Pad changes
    if auto_pad == "VALID":
        return [0] * (2 * spatial)
    pads = list(attr(node, "pads", [0] * (2 * spatial)))
    return pads if len(pads) == 2 * spatial else None


def _summed(own: list[int], begins: list[int], ends: list[int]) -> list[int]:
    k = len(begins)
    return [own[i] + begins[i] for i in range(k)] + [own[k + i] + ends[i] for i in range(k)]


@_merge_rule("Conv")
def _conv(node, value, begins, ends) -> dict | None:
    own = _explicit_pads(node, len(begins))
    if value != 0.0 or own is None:
        return None
    return {"pads": _summed(own, begins, ends)}


@_merge_rule("AveragePool")
def _average_pool(node, value, begins, ends) -> dict | None:
    own = _explicit_pads(node, len(begins))
    if value != 0.0 or own is None or attr(node, "ceil_mode", 0):
        return None  # with ceil_mode the last window may leave the padded input: divisors differ
    if not attr(node, "count_include_pad", 0) and any(own):
        return None  # the node's own pads are not counted but the Pad's zeros are
    return {"pads": _summed(own, begins, ends), "count_include_pad": 1}


@_merge_rule("MaxPool")
def _max_pool(node, value, begins, ends) -> dict | None:
    own = _explicit_pads(node, len(begins))
    if not np.isneginf(value) or own is None or attr(node, "ceil_mode", 0):
        return None
    if len(node.output) > 1 and node.output[1]:
        return None  # Indices would point into the padded tensor
    kernel = list(attr(node, "kernel_shape", []))
    dilations = list(attr(node, "dilations", [1] * len(kernel)))
    pads = _summed(own, begins, ends)
    if len(kernel) != len(begins) or len(dilations) != len(kernel):
        return None
    extent = [(k - 1) * d + 1 for k, d in zip(kernel, dilations, strict=True)]
    if any(p >= e for p, e in zip(pads, extent + extent, strict=True)):
        return None  # a window entirely in the padding: -inf from Pad, undefined as implicit pads
    return {"pads": pads}


def _constant(name: str, inits: dict, overridable: set[str]) -> np.ndarray | None:
    if name not in inits or name in overridable:
        return None
    return numpy_helper.to_array(inits[name])


def _pad_amounts(pad: onnx.NodeProto, rank: int, inits: dict, overridable: set[str]):
    """(begins, ends, value) over all ``rank`` axes of a constant-mode Pad, or None."""
    mode = attr(pad, "mode", b"constant")
    if (mode.decode() if isinstance(mode, bytes) else mode) != "constant" or len(pad.input) < 2:
        return None
    pads = _constant(pad.input[1], inits, overridable)
    if pads is None:
        return None
    pads = [int(p) for p in pads.ravel()]
    value = 0.0
    if len(pad.input) > 2 and pad.input[2]:
        constant = _constant(pad.input[2], inits, overridable)
        if constant is None or constant.size != 1:
            return None
        value = float(constant.ravel()[0])
    axes = list(range(rank))
    if len(pad.input) > 3 and pad.input[3]:  # opset 18 ``axes``
        given = _constant(pad.input[3], inits, overridable)
        if given is None:
            return None
        axes = [int(a) % rank for a in given.ravel()]
    if len(pads) != 2 * len(axes) or len(set(axes)) != len(axes):
        return None
    begins, ends = [0] * rank, [0] * rank
    for i, axis in enumerate(axes):
        begins[axis], ends[axis] = pads[i], pads[len(axes) + i]
    return begins, ends, value


def _spatial_rank(node: onnx.NodeProto, inits: dict) -> int | None:
    kernel = attr(node, "kernel_shape")
    if kernel is not None:
        return len(kernel)
    if node.op_type == "Conv" and len(node.input) > 1 and node.input[1] in inits:
        return len(inits[node.input[1]].dims) - 2
    return None


def _set_attributes(node: onnx.NodeProto, values: dict) -> None:
    """Set ``values`` and drop ``auto_pad``: explicit pads mean its default, NOTSET."""
    kept = [a for a in node.attribute if a.name not in values and a.name != "auto_pad"]
    del node.attribute[:]
    node.attribute.extend(kept)
    node.attribute.extend(helper.make_attribute(k, v) for k, v in values.items())


@register_pass("fold_pad")
def fold_pad(model: onnx.ModelProto) -> bool:
    graph = model.graph
    inits = initializers(graph)
    overridable = overridable_initializers(model)
    readers = consumers(graph)
    made = producers(graph)
    outputs = output_names(graph)
    folded = []
    for node in graph.node:
        rule = MERGE_RULES.get(node.op_type)
        if rule is None or node.domain not in DEFAULT_DOMAINS or not node.input:
            continue
        pad = made.get(node.input[0])
        if pad is None or pad.op_type != "Pad" or pad.domain not in DEFAULT_DOMAINS:
            continue
        if pad.output[0] in outputs or len(readers.get(pad.output[0], [])) != 1:
            continue  # someone else needs the padded tensor
        if list(node.input).count(pad.output[0]) != 1:
            continue  # the padded tensor is also the weight: leave such oddities alone
        spatial = _spatial_rank(node, inits)
        amounts = None if spatial is None else _pad_amounts(pad, spatial + 2, inits, overridable)
        if amounts is None:
            continue
        begins, ends, value = amounts
        if any(begins[:2]) or any(ends[:2]) or min(begins + ends) < 0:
            continue  # batch / channel padding or cropping is not a convolution's padding
        new_attrs = rule(node, value, begins[2:], ends[2:])
        if new_attrs is None:
            continue
        _set_attributes(node, new_attrs)
        node.input[0] = pad.input[0]
        drop_value_info(graph, [pad.output[0]])
        folded.append(pad)
    if folded:
        log.debug("merged %d Pad nodes into their consumers' pads", len(folded))
    return remove_nodes(graph, folded) > 0
