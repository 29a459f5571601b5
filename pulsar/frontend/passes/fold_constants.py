"""Constant folding, including Shape / Size of statically shaped tensors.

torch and Paddle exports compute reshape targets at run time (Shape -> Gather -> Unsqueeze ->
Concat -> Reshape). Once the input shapes are fixed those chains are constants; folding them gives
the quantizer and compiler plain static Reshapes. All foldable nodes are evaluated in one
onnxruntime session (node by node only if that fails), so folding costs one session per pass.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import helper, numpy_helper

from pulsar.frontend.check import session
from pulsar.frontend.graph import (
    DEFAULT_DOMAINS,
    TypeInfo,
    attr,
    consumers,
    drop_value_info,
    output_names,
    overridable_initializers,
    remove_nodes,
    subgraphs,
)
from pulsar.frontend.passes.registry import register_pass

log = logging.getLogger(__name__)

# Results above this many elements are folded only if they are not much bigger than the inputs.
MAX_GROWN_ELEMENTS = 1_000_000
MAX_GROWTH = 4

_NEVER_FOLD = {
    # random: folding would freeze one draw
    "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli",
    # the quantizer / compiler read quantization parameters from these nodes
    "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear",
    # non-tensor results
    "SequenceConstruct", "SequenceEmpty", "SequenceInsert", "SequenceErase", "SplitToSequence",
    "Optional", "OptionalGetElement", "OptionalHasElement",
}  # fmt: skip


def _numel(shape: tuple[int, ...] | None) -> int | None:
    return None if shape is None else int(np.prod(shape, dtype=np.int64))


def _fold_shapes(graph: onnx.GraphProto, info: TypeInfo, outputs: set[str]) -> list[onnx.NodeProto]:
    """Replace Shape / Size of tensors with a known static shape by initializers."""
    done = []
    for node in graph.node:
        if node.domain not in DEFAULT_DOMAINS or node.output[0] in outputs:
            continue
        shape = info.shape.get(node.input[0]) if node.input else None
        if shape is None:
            continue
        if node.op_type == "Shape":
            start, end = attr(node, "start", 0), attr(node, "end", None)
            value = np.array(shape[start:end], dtype=np.int64)
        elif node.op_type == "Size":
            value = np.array(_numel(shape), dtype=np.int64)
        else:
            continue
        graph.initializer.append(numpy_helper.from_array(value, node.output[0]))
        done.append(node)
    return done


def _too_big(sizes_in: list[int | None], sizes_out: list[int | None]) -> bool:
    known_in = sum(s for s in sizes_in if s is not None)
    return any(
        s is not None and s > MAX_GROWN_ELEMENTS and s > MAX_GROWTH * max(known_in, 1) for s in sizes_out
    )


def _candidates(model: onnx.ModelProto, info: TypeInfo, outputs: set[str]) -> list[onnx.NodeProto]:
    """Nodes computable from initializers alone, in graph order."""
    graph = model.graph
    overridable = overridable_initializers(model)
    constant = {t.name for t in graph.initializer if t.name not in overridable}
    found = []
    for node in graph.node:
        if (
            node.op_type in _NEVER_FOLD
            or node.domain not in DEFAULT_DOMAINS
            or any(True for _ in subgraphs(node))
            or not all(i in constant for i in node.input if i)
            or any(o in outputs for o in node.output)
        ):
            continue
        sizes_in = [_numel(info.shape.get(i)) for i in node.input if i]
        if _too_big(sizes_in, [_numel(info.shape.get(o)) for o in node.output if o]):
            continue
        found.append(node)
        constant.update(o for o in node.output if o)
    return found


def _evaluate(
    model: onnx.ModelProto, nodes: list[onnx.NodeProto], tensors: dict[str, onnx.TensorProto]
) -> dict[str, np.ndarray]:
    """Run ``nodes`` on constant inputs in one small onnxruntime model."""
    needed = {i for n in nodes for i in n.input if i} - {o for n in nodes for o in n.output}
    results = [o for n in nodes for o in n.output if o]
    graph = helper.make_graph(
        nodes,
        "fold",
        [],
        [helper.make_empty_tensor_value_info(name) for name in results],
        initializer=[tensors[name] for name in sorted(needed)],
    )
    small = helper.make_model(
        graph, opset_imports=list(model.opset_import), ir_version=max(model.ir_version, 4)
    )
    sess = session(small)
    return dict(zip(results, sess.run(results, {}), strict=True))


def _evaluate_all(model: onnx.ModelProto, nodes: list[onnx.NodeProto]) -> dict[str, np.ndarray]:
    tensors = {t.name: t for t in model.graph.initializer}
    try:
        return _evaluate(model, nodes, tensors)
    except Exception as exc:  # one op ORT cannot run must not stop the rest from folding
        log.debug("batched constant folding failed (%s); folding node by node", exc)
    values: dict[str, np.ndarray] = {}
    for node in nodes:
        inputs = [i for i in node.input if i]
        if not all(i in tensors or i in values for i in inputs):
            continue
        local = {i: tensors[i] if i in tensors else numpy_helper.from_array(values[i], i) for i in inputs}
        try:
            values.update(_evaluate(model, [node], local))
        except Exception as exc:
            log.debug("cannot fold %s (%s): %s", node.name, node.op_type, exc)
    return values


@register_pass("fold_constants")
def fold_constants(model: onnx.ModelProto) -> bool:
    graph = model.graph
    outputs = output_names(graph)
    info = TypeInfo.infer(model)
    shape_nodes = _fold_shapes(graph, info, outputs)
    remove_nodes(graph, shape_nodes)

    nodes = _candidates(model, info, outputs)
    values = _evaluate_all(model, nodes) if nodes else {}
    sizes = {t.name: int(np.prod(t.dims, dtype=np.int64)) for t in graph.initializer}
    sizes.update({k: int(v.size) for k, v in values.items() if isinstance(v, np.ndarray)})
    folded, failed = [], set()
    for node in nodes:
        outs = [o for o in node.output if o]
        ok = (
            not any(i in failed for i in node.input)
            and all(isinstance(values.get(o), np.ndarray) for o in outs)
            and not _too_big([sizes.get(i) for i in node.input if i], [sizes.get(o) for o in outs])
        )
        if ok:
            folded.append(node)
        else:
            failed.update(outs)

    folded_ids = {id(n) for n in folded}
    readers = consumers(graph)
    for node in folded:
        for out in node.output:
            if out and any(id(r) not in folded_ids for r in readers.get(out, [])):
                graph.initializer.append(numpy_helper.from_array(values[out], out))
    drop_value_info(graph, (o for n in [*shape_nodes, *folded] for o in n.output))
    remove_nodes(graph, folded)
    if shape_nodes or folded:
        log.debug("folded %d Shape/Size and %d constant nodes", len(shape_nodes), len(folded))
    return bool(shape_nodes or folded)
