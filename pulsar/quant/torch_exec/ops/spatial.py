"""(family of ONNX ops in torch: filled in below)."""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: F401

from pulsar.quant.torch_exec.ops.registry import Call, Tensor, _x, op  # noqa: F401

__all__: list[str] = []
_ = torch
