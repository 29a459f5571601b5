"""ONNX ops in torch for the fine-tuning executor, one family of ops per module, all in one registry.

Modules register in import order; a later module may replace an earlier entry of the same op type."""

from pulsar.quant.torch_exec.ops import (  # noqa: F401  (each registers its ops)
    attention,
    control,
    elementwise,
    nn,
    pool,
    recurrent,
    spatial,
    tensor,
)
from pulsar.quant.torch_exec.ops.registry import TORCH_OPS, Call, OpFn, op

__all__ = ["TORCH_OPS", "Call", "OpFn", "op"]
