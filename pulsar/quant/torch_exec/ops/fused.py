"""The ops pulsar's frontend fuses into (onnxruntime's ``com.microsoft`` GELU family); Gelu itself,
LayerNormalization, HardSigmoid / HardSwish and Softmax are standard ops in :mod:`.nn`."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pulsar.quant.torch_exec.ops.registry import Call, Tensor, _x, op


def _biased(c: Call) -> Tensor:
    x, bias = _x(c), c.input(1)
    return x if bias is None else x + bias


@op("FastGelu")
def fast_gelu(c: Call) -> list[Tensor]:
    """The tanh approximation, with the optional bias added first (as onnxruntime's kernel)."""
    x = _biased(c)
    return [0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))]


@op("BiasGelu")
def bias_gelu(c: Call) -> list[Tensor]:
    return [F.gelu(_biased(c))]


@op("QuickGelu")
def quick_gelu(c: Call) -> list[Tensor]:
    x = _x(c)
    return [x * torch.sigmoid(c.attr("alpha", 1.702) * x)]
