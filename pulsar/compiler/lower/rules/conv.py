"""Conv / ConvTranspose -> QConv / QConvTranspose (symmetric per-channel weights, bias on the
accumulator grid, one (M, N) per output channel)."""

from __future__ import annotations

import numpy as np

from pulsar.compiler.lower.rules.base import LowerCtx, Unsupported, rule
from pulsar.compiler.lower.rules.common import (
    bias_on_grid,
    channel_multipliers,
    explicit_pads,
    symmetric_weight,
    weights_and_bias,
)


def _spatial(ctx: LowerCtx, w: np.ndarray) -> tuple[tuple[int, ...], list[int], list[int]]:
    kernel = tuple(int(k) for k in w.shape[2:])
    if len(kernel) not in (1, 2):
        raise Unsupported(f"{ctx.op} with a {len(kernel)}-D kernel (the NPU runs 1-D and 2-D convolutions)")
    ks = ctx.attr("kernel_shape")
    if ks is not None and tuple(ks) != kernel:
        raise Unsupported(f"{ctx.op} kernel_shape {list(ks)} differs from its weight's {list(kernel)}")
    strides = list(ctx.attr("strides", [1] * len(kernel)))
    dilations = list(ctx.attr("dilations", [1] * len(kernel)))
    return kernel, strides, dilations


@rule("Conv")
def lower_conv(ctx: LowerCtx) -> None:
    xq = ctx.act(0)
    w_op, w_scale = symmetric_weight(ctx, 1, 0, packed_zp=True)
    w = w_op.value
    assert w is not None and w_op.q is not None
    kernel, strides, dilations = _spatial(ctx, w)
    x_shape = ctx.in_shape(0)
    pads = explicit_pads(ctx, x_shape[2:], kernel, strides, dilations)
    group = int(ctx.attr("group", 1))
    yq = ctx.out()
    weight, grid, bias, bound = weights_and_bias(ctx, w_op.q.name, w, 0, xq.s * w_scale, xq.max_centered, yq.s, 2)
    m, n = channel_multipliers(ctx, grid / yq.s, bound, "conv output scale")
    ctx.emit("QConv", [xq.name, weight, bias,
                       ctx.add_init("M", m), ctx.add_init("N", n), *ctx.weight_zp_inputs(weight)], [yq.name],
             x_zp=xq.zp, strides=strides, pads=pads, dilations=dilations, group=group, **ctx.common())


@rule("ConvTranspose")
def lower_conv_transpose(ctx: LowerCtx) -> None:
    xq = ctx.act(0)
    if ctx.attr("output_shape") is not None or ctx.attr_str("auto_pad", "NOTSET") != "NOTSET":
        raise Unsupported("ConvTranspose with output_shape / auto_pad: give explicit pads in the model")
    w_op, w_scale = symmetric_weight(ctx, 1, 1)
    w = w_op.value
    assert w is not None and w_op.q is not None
    kernel, strides, dilations = _spatial(ctx, w)
    group = int(ctx.attr("group", 1))
    cin, cout_g = w.shape[0], w.shape[1]
    cout = cout_g * group
    pads = list(ctx.attr("pads", [0] * 2 * len(kernel)))
    output_padding = list(ctx.attr("output_padding", [0] * len(kernel)))
    yq = ctx.out()
    grid = xq.s * np.tile(w_scale, group)
    bias, bias_abs = bias_on_grid(ctx, 2, grid)
    w_abs = np.abs(w.astype(np.int64)).reshape(group, cin // group, cout_g, -1)
    w_sum = w_abs.sum(axis=(1, 3)).reshape(cout)
    m, n = channel_multipliers(ctx, grid / yq.s, w_sum * float(xq.max_centered) + bias_abs,
                               "deconvolution output scale")
    ctx.emit("QConvTranspose", [xq.name, ctx.use_init(w_op.q.name), bias, ctx.add_init("M", m),
                                ctx.add_init("N", n)], [yq.name],
             x_zp=xq.zp, strides=strides, pads=pads, output_padding=output_padding, dilations=dilations,
             group=group, **ctx.common())
