"""Torch execution of the quantized graph (float or fake-quantized), for fine-tuning."""

from pulsar.quant.torch_exec.executor import QuantExecutor, unsupported_ops
from pulsar.quant.torch_exec.ops import TORCH_OPS

__all__ = ["TORCH_OPS", "QuantExecutor", "unsupported_ops"]
