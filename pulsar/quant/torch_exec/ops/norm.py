"""Normalization ops beyond Batch / Layer normalization: instance, group, local response, Lp and
mean-variance normalization, each in plain torch so that gradients reach the input and the affine
parameters."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pulsar.quant.torch_exec.ops.registry import Call, Tensor, _x, op


@op("InstanceNormalization")
def instance_norm(c: Call) -> list[Tensor]:
    x, scale, bias = _x(c), _x(c, 1), _x(c, 2)
    return [F.instance_norm(x, weight=scale, bias=bias, eps=float(c.attr("epsilon", 1e-5)))]


@op("GroupNormalization")
def group_norm(c: Call) -> list[Tensor]:
    """Opset 18 has one scale / bias per group, opset 21 one per channel (the same when groups == C)."""
    x, scale, bias = _x(c), _x(c, 1), _x(c, 2)
    g = int(c.attr("num_groups"))
    ch = x.shape[1]
    if scale.numel() != ch:  # opset 18: per group, repeated over the group's channels
        scale = scale.repeat_interleave(ch // g)
        bias = bias.repeat_interleave(ch // g)
    xs = x.reshape(x.shape[0], g, -1)
    mean = xs.mean(dim=-1, keepdim=True)
    var = ((xs - mean) ** 2).mean(dim=-1, keepdim=True)
    y = ((xs - mean) / torch.sqrt(var + float(c.attr("epsilon", 1e-5)))).reshape(x.shape)
    shape = [1, ch] + [1] * (x.dim() - 2)
    return [y * scale.reshape(shape) + bias.reshape(shape)]


@op("LRN")
def lrn(c: Call) -> list[Tensor]:
    """Window over channels ``[c - floor((size-1)/2), c + ceil((size-1)/2)]`` (torch's
    local_response_norm centres even windows the other way)."""
    x = _x(c)
    size = int(c.attr("size"))
    alpha, beta, bias = float(c.attr("alpha", 1e-4)), float(c.attr("beta", 0.75)), float(c.attr("bias", 1.0))
    sq = (x * x).unsqueeze(1)
    front, back = (size - 1) // 2, size - 1 - (size - 1) // 2
    pad = [0, 0] * (x.dim() - 2) + [front, back]
    window = F.pad(sq, pad).unfold(2, size, 1).sum(-1).squeeze(1)
    return [x / (bias + alpha / size * window) ** beta]


@op("LpNormalization")
def lp_norm(c: Call) -> list[Tensor]:
    x = _x(c)
    axis, p = int(c.attr("axis", -1)), int(c.attr("p", 2))
    norm = x.abs().sum(dim=axis, keepdim=True) if p == 1 else torch.sqrt((x * x).sum(dim=axis, keepdim=True))
    return [x / torch.where(norm == 0, torch.ones_like(norm), norm)]  # a zero vector stays zero (onnxruntime)


@op("MeanVarianceNormalization")
def mvn(c: Call) -> list[Tensor]:
    x = _x(c)
    axes = tuple(int(a) for a in (c.attr("axes") or [0, 2, 3]))
    mean = x.mean(dim=axes, keepdim=True)
    var = (x * x).mean(dim=axes, keepdim=True) - mean * mean
    return [(x - mean) / (torch.sqrt(var) + 1e-9)]
