"""Lowering: a QDQ ONNX model -> NPU subgraphs (``pulsar.int`` integer programs, see
notes/npu_ir.md) and CPU subgraphs (float ONNX), in execution order."""

from __future__ import annotations

from pulsar.compiler.lower.model import Fallback, LoweredModel, LowerOptions
from pulsar.compiler.lower.partition import fallback_report, lower_qdq_model, placement_counts
from pulsar.compiler.lower.rules import INT_DOMAIN, RULES

__all__ = ["INT_DOMAIN", "RULES", "Fallback", "LowerOptions", "LoweredModel", "fallback_report", "lower_qdq_model",
           "placement_counts"]
