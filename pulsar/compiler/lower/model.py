"""The lowering's options and result."""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx

from pulsar.compiler.package import Subgraph


@dataclass
class LowerOptions:
    lut_items_in_bits: int = 10          # 16-bit LUT inputs: 2**bits + 1 knots
    npu_ops: set[str] | None = None      # None: every op with a rule may go to the NPU


@dataclass
class Fallback:
    """An op kept on the CPU and why (one user-facing line, with how to move it when possible)."""

    node: str
    op_type: str
    reason: str


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
