"""Quantize-dequantize in torch, with straight-through gradients.

Same arithmetic as the QDQ export that onnxruntime runs and the integer backend reproduces:
``q = clip(round_half_even(x / scale) + zero_point, quant_min, quant_max)``, ``x' = (q - zero_point) * scale``
in float32. The rounding's gradient is passed straight through; clipping stops the gradient of the
clipped elements (so the LSQ scale gradient comes out of autograd: ``round(x/s) - x/s`` inside the
range, ``q_min - z`` / ``q_max - z`` outside).
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor

ZETA, GAMMA = 1.1, -0.1  # AdaRound's rectified sigmoid stretch


def round_ste(x: Tensor) -> Tensor:
    """Round half to even (as QuantizeLinear), gradient 1."""
    return x + (torch.round(x) - x).detach()


def floor_ste(x: Tensor) -> Tensor:
    return x + (torch.floor(x) - x).detach()


def grad_scale(x: Tensor, g: float) -> Tensor:
    """Value ``x``, gradient scaled by ``g`` (LSQ's step-size gradient scaling)."""
    return (x - x * g).detach() + x * g


def channel_shape(x: Tensor, axis: int | None) -> list[int]:
    shape = [1] * x.dim()
    if axis is not None:
        shape[axis] = -1
    return shape


def _native(x: Tensor, scale: Tensor, zero_point: Tensor, qmin: int, qmax: int, axis: int | None) -> Tensor:
    """torch's fused fake-quantize kernels (one pass forward, one backward, the same straight-through
    and clipping gradients, LSQ's scale gradient where the scale is trained). They multiply by 1 /
    scale where QuantizeLinear divides, so a value on a rounding tie can land one step off: used
    while training only, where that does not matter, never for the outputs compared or kept."""
    if scale.requires_grad:
        if axis is None or not scale.dim():
            return torch._fake_quantize_learnable_per_tensor_affine(
                x, scale.reshape(1), zero_point.reshape(1).to(x.dtype), qmin, qmax, 1.0)
        return torch._fake_quantize_learnable_per_channel_affine(
            x, scale, zero_point.to(x.dtype).expand_as(scale), axis, qmin, qmax, 1.0)
    if axis is None or not scale.dim():
        return torch.fake_quantize_per_tensor_affine(x, scale.reshape(()), zero_point.reshape(()).to(torch.int32),
                                                     qmin, qmax)
    return torch.fake_quantize_per_channel_affine(x, scale, zero_point.to(torch.int32).expand_as(scale), axis,
                                                  qmin, qmax)


def fake_quant(x: Tensor, scale: Tensor, zero_point: Tensor, qmin: int, qmax: int, axis: int | None) -> Tensor:
    # not for 32-bit grids (biases: beyond float32's exact integers) nor 1-D tensors (torch's learnable
    # per-channel kernel returns a wrong-shaped scale gradient there)
    if torch.is_grad_enabled() and x.dtype == torch.float32 and (x.requires_grad or scale.requires_grad) \
            and scale.dtype == torch.float32 and x.dim() >= 2 and qmax - qmin <= 65535:
        return _native(x, scale, zero_point, qmin, qmax, axis)
    shape = channel_shape(x, axis) if scale.dim() else []
    s = scale.reshape(shape) if shape else scale
    z = zero_point.reshape(shape) if shape else zero_point
    q = torch.clamp(round_ste(x / s) + z, qmin, qmax)
    return (q - z) * s


def lsq_grad_factor(numel: int, qmax: int) -> float:
    """LSQ: g = 1 / sqrt(N * Q_P) balances the step size's update with the weights' (Esser et al. 2020)."""
    return 1.0 / math.sqrt(max(1, numel) * max(1, qmax))


def rectified_sigmoid(v: Tensor) -> Tensor:
    """AdaRound's h(V) in [0, 1]: sigmoid stretched to (GAMMA, ZETA) and clipped, so it can reach 0 and 1."""
    return torch.clamp(torch.sigmoid(v) * (ZETA - GAMMA) + GAMMA, 0.0, 1.0)


def rectified_sigmoid_inverse(h: Tensor) -> Tensor:
    """V with h(V) = ``h`` (for h strictly inside (0, 1)): the starting point that rounds to nearest."""
    p = torch.clamp((h - GAMMA) / (ZETA - GAMMA), 1e-6, 1 - 1e-6)
    return torch.log(p / (1 - p))


def rounding_regularizer(v: Tensor, beta: float) -> Tensor:
    """sum(1 - |2h(V) - 1|^beta): zero when every h is 0 or 1, pushes each toward one of them."""
    return (1 - (2 * rectified_sigmoid(v) - 1).abs().pow(beta)).sum()
