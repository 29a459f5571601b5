"""Reductions (ReduceX, ArgMax / ArgMin) and the losses built on them (NegativeLogLikelihoodLoss,
SoftmaxCrossEntropyLoss).

Every reduction reads its axes from the ``axes`` attribute (early opsets) or the second input (later
ones); no axes reduce everything, unless ``noop_with_empty_axes`` asks for the input unchanged."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from pulsar.quant.torch_exec.ops.registry import Call, Tensor, _x, op


def _reduce_axes(c: Call, x: Tensor) -> list[int] | None:
    """The axes to reduce, normalised; None when the node is a no-op (empty axes + noop_with_empty_axes)."""
    axes = c.attr("axes")
    if axes is None:
        axes = c.ints(1)
    if not axes:
        return None if c.attr("noop_with_empty_axes", 0) else list(range(x.dim()))
    return sorted({int(a) % max(1, x.dim()) for a in axes})


def _prod(x: Tensor, axes: list[int], keep: bool) -> Tensor:
    """torch.prod takes one axis at a time: from the last so the earlier indices stay valid."""
    for a in sorted(axes, reverse=True):
        x = x.prod(dim=a, keepdim=keep)
    return x


def _empty(x: Tensor, axes: list[int], keep: bool, lowest: bool) -> Tensor | None:
    """Max / min over an empty set: the dtype's lowest / highest value (-inf / inf for floats), per the spec."""
    if all(x.shape[a] for a in axes):
        return None
    shape = [1 if a in axes else n for a, n in enumerate(x.shape) if keep or a not in axes]
    if x.dtype == torch.bool:
        return torch.full(shape, not lowest, dtype=torch.bool, device=x.device)
    if x.dtype.is_floating_point:
        value = -math.inf if lowest else math.inf
    else:
        value = torch.iinfo(x.dtype).min if lowest else torch.iinfo(x.dtype).max
    return torch.full(shape, value, dtype=x.dtype, device=x.device)


def _amax(x: Tensor, axes: list[int], keep: bool) -> Tensor:
    empty = _empty(x, axes, keep, lowest=True)
    if empty is not None:
        return empty
    return x.any(dim=tuple(axes), keepdim=keep) if x.dtype == torch.bool else x.amax(dim=axes, keepdim=keep)


def _amin(x: Tensor, axes: list[int], keep: bool) -> Tensor:
    empty = _empty(x, axes, keep, lowest=False)
    if empty is not None:
        return empty
    return x.all(dim=tuple(axes), keepdim=keep) if x.dtype == torch.bool else x.amin(dim=axes, keepdim=keep)


def _sum(x: Tensor, axes: list[int], keep: bool) -> Tensor:
    return x.sum(dim=axes, keepdim=keep, dtype=x.dtype)


_REDUCE: dict[str, Callable[[Tensor, list[int], bool], Tensor]] = {
    "ReduceMax": _amax,
    "ReduceMin": _amin,
    "ReduceSum": _sum,
    "ReduceMean": lambda x, a, k: x.mean(dim=a, keepdim=k),
    "ReduceProd": _prod,
    "ReduceL1": lambda x, a, k: _sum(x.abs(), a, k),
    "ReduceL2": lambda x, a, k: torch.sqrt(_sum(x * x, a, k)),
    "ReduceSumSquare": lambda x, a, k: _sum(x * x, a, k),
    "ReduceLogSum": lambda x, a, k: torch.log(_sum(x, a, k)),
    "ReduceLogSumExp": lambda x, a, k: torch.logsumexp(x, dim=a, keepdim=k),
}


@op(*_REDUCE)
def reduce(c: Call) -> list[Tensor]:
    x = _x(c)
    axes = _reduce_axes(c, x)
    if axes is None:
        return [x]
    return [_REDUCE[c.attrs["_op"]](x, axes, bool(c.attr("keepdims", 1)))]


@op("ArgMax", "ArgMin")
def arg_max_min(c: Call) -> list[Tensor]:
    """torch returns the first extreme index; ``select_last_index`` looks from the other end."""
    x = _x(c)
    axis = c.attr("axis", 0) % x.dim()
    keep = bool(c.attr("keepdims", 1))
    fn = torch.argmax if c.attrs["_op"] == "ArgMax" else torch.argmin
    if x.dtype == torch.bool:
        x = x.to(torch.uint8)
    if c.attr("select_last_index", 0):
        idx = x.shape[axis] - 1 - fn(x.flip(axis), dim=axis, keepdim=keep)
    else:
        idx = fn(x, dim=axis, keepdim=keep)
    return [idx.to(torch.int64)]


def _nll(logp: Tensor, target: Tensor, weight: Tensor | None, ignore: int | None, reduction: str) -> Tensor:
    """-logp[n, target[n, ...], ...] x weight[target], ignored targets counting neither loss nor weight;
    ``mean`` divides by the summed weights (the spec, as torch)."""
    target = target.to(torch.int64)
    keep = torch.ones_like(target, dtype=torch.bool) if ignore is None else target != ignore
    safe = torch.where(keep, target, torch.zeros_like(target))
    picked = -torch.gather(logp, 1, safe.unsqueeze(1)).squeeze(1)
    w = torch.ones_like(picked) if weight is None else weight[safe]
    w = torch.where(keep, w, torch.zeros_like(w))
    loss = picked * w
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / w.sum()


@op("NegativeLogLikelihoodLoss")
def nll_loss(c: Call) -> list[Tensor]:
    return [_nll(_x(c), _x(c, 1), c.input(2), c.attr("ignore_index"), c.attr("reduction", "mean"))]


@op("SoftmaxCrossEntropyLoss")
def softmax_cross_entropy(c: Call) -> list[Tensor]:
    logp = torch.log_softmax(_x(c), dim=1)
    loss = _nll(logp, _x(c, 1), c.input(2), c.attr("ignore_index"), c.attr("reduction", "mean"))
    return [loss, logp][: c.n_outputs]
