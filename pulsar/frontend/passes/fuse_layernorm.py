"""LayerNorm written out in primitives -> ``LayerNormalization`` (opset 17).

Paddle and hand-written torch / TF models compute ``(x - mean) / sqrt(var + eps) * gamma + beta``
from ReduceMean, Sub, Pow (or Mul by itself), Add, Sqrt and Div (or Mul by Reciprocal): nine
nodes whose intermediates the quantizer would otherwise calibrate one by one, with the variance in
particular far outside an int8 range. The exporters differ in whether ``x - mean`` is computed once
and reused or twice, in Div versus Mul by Reciprocal, in the axes (attribute before opset 18,
input after) and in whether gamma / beta exist; all of these fuse. TF / Keras (via
``tf.nn.batch_normalization``) folds gamma into the inverse deviation first and computes
``x * k + (beta - mean * k)``; that form fuses too. Missing gamma / beta become ones / zeros, so the
fused node always has the same three inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from pulsar.frontend.graph import DEFAULT_DOMAINS
from pulsar.frontend.passes.pattern import FusionContext, binary_const, opset, run_fusion
from pulsar.frontend.passes.registry import register_pass


def _layer_axis(ctx: FusionContext, node: onnx.NodeProto, x: str) -> int | None:
    """The LayerNormalization axis if ``node`` (keepdims) reduces the trailing axes of ``x``."""
    found = ctx.reduce_axes(node)
    if found is None or not found[1] or not found[0]:
        return None
    axes = sorted(set(found[0]))
    rank = ctx.rank(x)
    if rank is not None:
        axes = sorted({a % rank for a in axes if -rank <= a < rank})
        if len(axes) != len(found[0]) or axes != list(range(rank - len(axes), rank)):
            return None
        return axes[0] - rank
    if axes != list(range(-len(axes), 0)):
        return None
    return axes[0]


def _per_feature(ctx: FusionContext, name: str, shape: tuple[int, ...], rank: int) -> np.ndarray | None:
    """A float32 constant that varies over the normalized axes only, broadcast to their ``shape``."""
    value = ctx.const(name)
    if value is None or value.dtype != np.float32 or value.ndim > rank:
        return None
    lead = value.ndim - len(shape)
    if lead > 0:
        if any(d != 1 for d in value.shape[:lead]):
            return None  # varies over the non-normalized axes
        value = value.reshape(value.shape[lead:])
    try:
        return np.ascontiguousarray(np.broadcast_to(value, shape))
    except ValueError:
        return None


def _affine(
    ctx: FusionContext, name: str, op_type: str, shape: tuple[int, ...], rank: int
) -> tuple[onnx.NodeProto, np.ndarray] | None:
    """The only reader of ``name`` if it is ``op_type`` with a per-feature constant, and that constant."""
    node = ctx.sole_reader(name, op_type)
    if node is None or len(node.input) != 2 or name not in node.input:
        return None
    value = _per_feature(ctx, node.input[1] if node.input[0] == name else node.input[0], shape, rank)
    return None if value is None else (node, value)


@dataclass
class _Tail:
    """What follows the standard deviation: the nodes, the result and the affine parameters."""

    nodes: list[onnx.NodeProto]
    result: str
    scale: np.ndarray
    bias: np.ndarray


def _denominator(
    ctx: FusionContext, var_of: str, axis: int, x: str
) -> tuple[float, list[onnx.NodeProto], str] | None:
    """From ``var_of = x - mean``: (eps, nodes, sqrt output) of ``sqrt(mean(var_of^2) + eps)``."""
    square = next(
        (
            r
            for r in ctx.readers.get(var_of, [])
            if r.domain in DEFAULT_DOMAINS
            and (
                (r.op_type == "Pow" and r.input[0] == var_of and ctx.scalar(r.input[1]) == 2.0)
                or (r.op_type == "Mul" and list(r.input) == [var_of, var_of])
            )
        ),
        None,
    )
    if square is None:
        return None
    mean2 = ctx.sole_reader(square.output[0], "ReduceMean")
    if mean2 is None or _layer_axis(ctx, mean2, x) != axis:
        return None
    add = ctx.sole_reader(mean2.output[0], "Add")
    split = binary_const(ctx, add) if add is not None else None
    if split is None or split[1] < 0:
        return None
    sqrt = ctx.sole_reader(add.output[0], "Sqrt")
    if sqrt is None:
        return None
    return split[1], [square, mean2, add, sqrt], sqrt.output[0]


def _inverse(ctx: FusionContext, root: str) -> onnx.NodeProto | None:
    """``Reciprocal(root)`` or ``Div(1, root)``."""
    node = ctx.sole_reader(root, "Div", "Reciprocal")
    if node is not None and node.op_type == "Div":
        return node if node.input[1] == root and ctx.scalar(node.input[0]) == 1.0 else None
    return node


def _divided_tail(
    ctx: FusionContext, diffs: set[str], root: str, shape: tuple[int, ...], rank: int
) -> _Tail | None:
    """``d / root`` or ``d * (1 / root)``, then optionally ``* gamma`` and ``+ beta``."""
    node = ctx.sole_reader(root, "Div")
    if node is not None and node.input[1] == root and node.input[0] in diffs:
        nodes, result = [node], node.output[0]
    else:
        inv = _inverse(ctx, root)
        mul = ctx.sole_reader(inv.output[0], "Mul") if inv is not None else None
        if inv is None or mul is None or len(mul.input) != 2 or inv.output[0] not in mul.input:
            return None
        d = mul.input[1] if mul.input[0] == inv.output[0] else mul.input[0]
        if d not in diffs:
            return None
        nodes, result = [inv, mul], mul.output[0]
    tail = _Tail(nodes, result, np.ones(shape, np.float32), np.zeros(shape, np.float32))
    for op_type in ("Mul", "Add"):
        step = _affine(ctx, tail.result, op_type, shape, rank)
        if step is not None:
            tail.nodes.append(step[0])
            tail.result = step[0].output[0]
            if op_type == "Mul":
                tail.scale = step[1]
            else:
                tail.bias = step[1]
    return tail


def _folded_tail(
    ctx: FusionContext, x: str, m: str, root: str, shape: tuple[int, ...], rank: int
) -> _Tail | None:
    """TF / Keras: ``x * k + (beta - mean * k)`` with ``k = gamma / root`` (gamma, beta optional)."""
    inv = _inverse(ctx, root)
    if inv is None:
        return None
    nodes, k = [inv], inv.output[0]
    scale = np.ones(shape, np.float32)
    step = _affine(ctx, k, "Mul", shape, rank)
    if step is not None:
        nodes.append(step[0])
        k, scale = step[0].output[0], step[1]
    muls = ctx.readers.get(k, [])
    if k in ctx.outputs or len(muls) != 2 or not all(n.op_type == "Mul" and len(n.input) == 2 for n in muls):
        return None
    by_other = {(n.input[1] if n.input[0] == k else n.input[0]): n for n in muls}
    if set(by_other) != {x, m}:
        return None
    xk, mk = by_other[x], by_other[m]
    shift = ctx.sole_reader(mk.output[0], "Sub", "Neg")
    if shift is None or not ctx.private(shift.output[0]):
        return None
    bias = np.zeros(shape, np.float32)
    if shift.op_type == "Sub":
        value = _per_feature(ctx, shift.input[0], shape, rank)
        if shift.input[1] != mk.output[0] or value is None:
            return None
        bias = value
    add = ctx.sole_reader(xk.output[0], "Add")
    if add is None or sorted(add.input) != sorted([xk.output[0], shift.output[0]]):
        return None
    return _Tail([*nodes, xk, mk, shift, add], add.output[0], scale, bias)


def _match(ctx: FusionContext, mean: onnx.NodeProto) -> bool:
    x = mean.input[0]
    axis = _layer_axis(ctx, mean, x)
    rank, dims = ctx.rank(x), ctx.dims.get(x)
    if axis is None or rank is None or dims is None or not ctx.is_float32(x):
        return False
    shape = tuple(dims[axis:])
    if not all(isinstance(d, int) and d > 0 for d in shape):
        return False
    m = mean.output[0]
    readers = ctx.readers.get(m, [])
    subs = [
        s for s in readers if s.op_type == "Sub" and s.domain in DEFAULT_DOMAINS and list(s.input) == [x, m]
    ]
    if m in ctx.outputs or not 1 <= len(subs) <= 2 or len(readers) > len(subs) + 1:
        return False
    den = None
    for var_of in (s.output[0] for s in subs):
        den = _denominator(ctx, var_of, axis, x)
        if den is not None:
            break
    if den is None:
        return False
    eps, den_nodes, root = den
    if len(readers) == len(subs):
        tail = _divided_tail(ctx, {s.output[0] for s in subs}, root, shape, rank)
    else:  # the mean is read once more: the Keras form re-uses it for the shift
        tail = _folded_tail(ctx, x, m, root, shape, rank)
    if tail is None:
        return False
    nodes = [mean, *subs, *den_nodes, *tail.nodes]
    # Every difference and the mean must feed only this pattern.
    if not all(ctx.only_read_by(name, nodes) for name in [m, *(s.output[0] for s in subs)]):
        return False
    base = ctx.node_name(nodes, "LayerNormalization")
    weights = {ctx.tensor_name(f"{base}.scale"): tail.scale, ctx.tensor_name(f"{base}.bias"): tail.bias}
    fused = helper.make_node(
        "LayerNormalization", [x, *weights], [tail.result], name=base, axis=axis, epsilon=float(eps)
    )
    return ctx.fuse(nodes, [fused], weights)


@register_pass("fuse_layernorm")
def fuse_layernorm(model: onnx.ModelProto) -> bool:
    if opset(model) < 17:  # no LayerNormalization before opset 17
        return False
    return run_fusion(model, ("ReduceMean",), _match, "LayerNorm")
