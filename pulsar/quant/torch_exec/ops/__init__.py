"""ONNX ops in torch for the fine-tuning executor, one family of ops per module, all in one registry."""

from pulsar.quant.torch_exec.ops import nn  # noqa: F401  (registers its ops)
from pulsar.quant.torch_exec.ops.registry import TORCH_OPS, Call, OpFn, op

__all__ = ["TORCH_OPS", "Call", "OpFn", "op"]
