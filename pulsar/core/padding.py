"""ONNX ``auto_pad`` as explicit ``pads``: one formula for the frontend pass and the lowering."""

from __future__ import annotations

from collections.abc import Sequence


def auto_pads(mode: str, in_spatial: Sequence[int], kernel: Sequence[int], strides: Sequence[int],
              dilations: Sequence[int]) -> list[int]:
    """``pads`` (begins..., ends...) that ``auto_pad`` ``mode`` (VALID, SAME_UPPER, SAME_LOWER) means for
    an input of spatial size ``in_spatial``: SAME keeps ceil(x / stride) outputs, the odd pixel of the
    total at the end (UPPER) or the beginning (LOWER)."""
    if mode == "VALID":
        return [0] * 2 * len(kernel)
    begin, end = [], []
    for x, k, s, d in zip(in_spatial, kernel, strides, dilations, strict=True):
        out = -(-x // s)
        total = max((out - 1) * s + (k - 1) * d + 1 - x, 0)
        small, big = total // 2, total - total // 2
        b, e = (small, big) if mode == "SAME_UPPER" else (big, small)
        begin.append(b)
        end.append(e)
    return begin + end
