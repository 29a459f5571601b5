"""The lowering's options and result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import onnx

from pulsar.core.container import Subgraph


@dataclass
class SubRange:
    """A ``compiler.sub_configs`` entry: the ops between its tensors become their own NPU subgraph(s),
    lowered with ``options`` (the effective compiler options: the top level's, overridden)."""

    name: str
    start_tensor_names: list[str]
    end_tensor_names: list[str]
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def lut_items_in_bits(self) -> int | None:
        value = self.options.get("lut_items_in_bits")
        return None if value is None else int(value)


@dataclass
class LowerOptions:
    lut_items_in_bits: int = 10          # 16-bit LUT inputs: 2**bits + 1 knots
    npu_ops: set[str] | None = None      # None: every op with a rule may go to the NPU
    sub_configs: list[SubRange] = field(default_factory=list)  # ranges lowered apart, first match wins
    # node -> why: ops the quantization placed on the CPU stay there (a manual op or an FP32 layer whose
    # neighbours quantize its input and output would otherwise be lowered at their grids)
    cpu_nodes: dict[str, str] = field(default_factory=dict)


@dataclass
class Fallback:
    """An op kept on the CPU and why (one user-facing line, with how to move it when possible)."""

    node: str
    op_type: str
    reason: str


@dataclass
class LoweredOp:
    """One NPU op as the op counts see it: the QDQ compute nodes it stands for (the op, then the Relu /
    Clip or lookup-table links fused into it) and the integer ops it was lowered to."""

    nodes: list[str]
    op_types: list[str]
    integer_ops: list[str]


@dataclass
class LoweredModel:
    subgraphs: list[Subgraph]                 # in execution order; kind "npu" / "cpu"; graph = body
    references: dict[str, onnx.GraphProto]    # NPU subgraph name -> reference_body (QDQ fragment)
    fallbacks: list[Fallback]
    inputs: list[onnx.ValueInfoProto]
    outputs: list[onnx.ValueInfoProto]
    # opsets the bodies need: the QDQ model's plus pulsar.int (version 1)
    opset_imports: list[onnx.OperatorSetIdProto] = field(default_factory=list)
    # QDQ compute node name -> "npu" / "cpu" (Q / DQ nodes are not listed)
    placement: dict[str, str] = field(default_factory=dict)
    # NPU subgraph name -> its ops in order (model ops -> integer ops), for the op-count report
    ops: dict[str, list[LoweredOp]] = field(default_factory=dict)
