"""Fuse MatMul by a constant matrix plus a constant bias into one Gemm.

Exporters write ``nn.Linear`` on a 2-D input as MatMul + Add. The quantizer and the NPU treat Gemm
as one fully connected layer with an int32 bias; as two nodes the sum would be requantized after
the MatMul. Gemm is strictly 2-D, so MatMuls on rank-3+ activations (transformer blocks) stay as
they are.
"""

from __future__ import annotations

import logging

import onnx
from onnx import TensorProto, helper

from pulsar.frontend.graph import (
    DEFAULT_DOMAINS,
    consumers,
    dims_of,
    drop_value_info,
    initializers,
    output_names,
    overridable_initializers,
    producers,
    remove_nodes,
)
from pulsar.frontend.passes.registry import register_pass
from pulsar.frontend.shapes import inferred_graph

log = logging.getLogger(__name__)

_GEMM_TYPES = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16}


def _ranks(model: onnx.ModelProto) -> dict[str, int]:
    """Tensor name -> rank, as far as shape inference knows (symbolic dims are fine)."""
    graph = inferred_graph(model)  # the large initializers there are inputs of the same dims
    ranks = {t.name: len(t.dims) for t in graph.initializer}
    for vi in [*graph.input, *graph.value_info, *graph.output]:
        dims = dims_of(vi)
        if dims is not None:
            ranks.setdefault(vi.name, len(dims))
    return ranks


def _bias_fits(bias: onnx.TensorProto, n: int) -> bool:
    """True when the bias broadcasts onto [M, N] without growing it: [], [1], [N], [1, N], [1, 1]."""
    dims = list(bias.dims)
    return len(dims) <= 2 and all(d == 1 for d in dims[:-1]) and (not dims or dims[-1] in (1, n))


@register_pass("fuse_matmul_add")
def fuse_matmul_add(model: onnx.ModelProto) -> bool:
    graph = model.graph
    inits = initializers(graph)
    constant = set(inits) - overridable_initializers(model)
    readers = consumers(graph)
    made = producers(graph)
    outputs = output_names(graph)
    ranks: dict[str, int] | None = None
    fused = []
    for add in graph.node:
        if add.op_type != "Add" or add.domain not in DEFAULT_DOMAINS or len(add.input) != 2:
            continue
        for i in (0, 1):
            matmul, bias_name = made.get(add.input[i]), add.input[1 - i]
            if matmul is not None and matmul.op_type == "MatMul" and bias_name in constant:
                break
        else:
            continue
        if matmul.domain not in DEFAULT_DOMAINS or matmul.input[1] not in constant:
            continue
        if matmul.output[0] in outputs or len(readers.get(matmul.output[0], [])) != 1:
            continue  # the product without bias is needed elsewhere
        weight, bias = inits[matmul.input[1]], inits[bias_name]
        if len(weight.dims) != 2 or weight.data_type not in _GEMM_TYPES or bias.data_type != weight.data_type:
            continue
        if not _bias_fits(bias, weight.dims[1]):
            continue
        if ranks is None:
            ranks = _ranks(model)  # inference only once a candidate is found
        if ranks.get(matmul.input[0]) != 2:
            continue  # Gemm is 2-D only; higher ranks stay MatMul + Add
        gemm = helper.make_node(
            "Gemm", [matmul.input[0], matmul.input[1], bias_name], [add.output[0]], name=matmul.name
        )
        drop_value_info(graph, [matmul.output[0]])
        matmul.CopyFrom(gemm)  # in the MatMul's place: its inputs exist there, the Add's readers follow
        fused.append(add)
    if fused:
        log.debug("fused %d MatMul + Add pairs into Gemm", len(fused))
    return remove_nodes(graph, fused) > 0
