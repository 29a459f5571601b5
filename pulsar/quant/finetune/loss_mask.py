"""``quant.finetune_loss_mask``: weigh fine-tuning's losses by the positions the model's user reads.

A text model fed fixed-length, padded sequences computes outputs at every position, but the user's
post-processing reads only the real tokens (mean pooling over ``attention_mask``, a classifier on
the first token). Its padding positions carry the largest quantization errors, so an unweighted
mean square spends the training on them: on all-MiniLM-L6-v2 (82% of 128 positions padding), LSQ
raised the padding positions' SQNR from 20.5 to 23.4 dB and lowered the real tokens' from 27.6 to
24.2 dB, and the sentence embeddings moved away from float. With the mask named, every compared
tensor whose leading dimensions are the mask's shape ([batch, positions] against [batch,
positions, features]) counts only the positions the mask marks non-zero; other tensors count whole.
"""

from __future__ import annotations

import numpy as np
import onnx
import torch

from pulsar.errors import PulsarError

FIELD = "quant.finetune_loss_mask"


def check_mask_input(model: onnx.ModelProto, name: str) -> None:
    """Before calibration: the field names a model input of rank 2 or more."""
    if not name:
        return
    inputs = {i.name: i for i in model.graph.input}
    if name not in inputs:
        listed = ", ".join(inputs) or "none"
        raise PulsarError(f'{FIELD}: "{name}" is not an input of the model (its inputs: {listed}); name the input '
                          f"that marks the positions your post-processing reads, or leave the field empty")
    dims = inputs[name].type.tensor_type.shape.dim
    if len(dims) < 2:
        raise PulsarError(f'{FIELD}: input "{name}" has rank {len(dims)}; a loss mask is [batch, positions, ...] '
                          f"(rank 2 or more), like a text model's attention_mask")


def sample_mask(sample: dict[str, np.ndarray], name: str) -> np.ndarray:
    """One calibration sample's mask as float32 (non-zero: read)."""
    mask: np.ndarray = (np.asarray(sample[name]) != 0).astype(np.float32)
    return mask


def _weights(t: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
    if mask is None or t.dim() <= mask.dim() or tuple(t.shape[:mask.dim()]) != tuple(mask.shape):
        return None
    return mask.reshape(*mask.shape, *([1] * (t.dim() - mask.dim())))


def squared_error(got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean square of ``got - want`` over the positions ``mask`` marks (all where it does not apply)."""
    diff = (got - want) ** 2
    w = _weights(want, mask)
    if w is None:
        return diff.mean()
    per_position = diff.numel() // max(1, w.numel())
    return (diff * w).sum() / torch.clamp(w.sum() * per_position, min=1.0)


def per_sample_error(got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor | None, n: int) -> torch.Tensor:
    """The same mean square per sample of ``n`` stacked along axis 0: shape [n]."""
    diff = ((got - want) ** 2).reshape(n, -1)
    w = _weights(want, mask)
    if w is None:
        return diff.mean(1)
    full = torch.broadcast_to(w, want.shape).reshape(n, -1)
    return (diff * full).sum(1) / torch.clamp(full.sum(1), min=1.0)


def mean_square(t: np.ndarray, mask: np.ndarray | None) -> float:
    """Mean square of a float target over the positions ``mask`` marks (all where it does not apply)."""
    t64 = t.astype(np.float64)
    if mask is None or t64.ndim <= mask.ndim or t64.shape[:mask.ndim] != mask.shape:
        return float(np.mean(t64 ** 2))
    w = np.broadcast_to(mask.reshape(*mask.shape, *([1] * (t64.ndim - mask.ndim))), t64.shape)
    return float((t64 ** 2 * w).sum() / max(float(w.sum()), 1.0))
