"""The torch-op registry: one small function per ONNX op type, called with the node's attributes and inputs.

Our own interpreter rather than a converter such as onnx2torch: the fine-tuning executor has to put a
fake quantizer on exactly the tensors the QDQ export quantizes (by ONNX tensor name) and run any
slice of the graph (a block) from any set of tensors; an interpreter over the ONNX nodes gives both
directly, where a converted ``nn.Module`` hides the names behind its own FX graph (the measured
comparison is in the README). Every function follows the ONNX operator spec (attribute defaults,
later opsets' inputs in place of attributes) and is checked against onnxruntime by
``python -m bench.conformance.torch_exec`` on every built ONNX node test.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

Tensor = torch.Tensor
# runs a subgraph (a GRAPH attribute) on its inputs, outer-scope tensors visible: its outputs
GraphRunner = Callable[[Any, Sequence[Tensor | None]], list[Tensor]]


@dataclass
class Call:
    """One node's call: its attributes and its inputs (None for an omitted optional input)."""

    attrs: dict[str, Any]
    inputs: list[Tensor | None]
    run_graph: GraphRunner | None = field(default=None, repr=False)

    def attr(self, name: str, default: Any = None) -> Any:
        return self.attrs.get(name, default)

    def input(self, index: int) -> Tensor | None:
        """An optional input: None when omitted or beyond the node's inputs."""
        return self.inputs[index] if index < len(self.inputs) else None

    def ints(self, index: int) -> list[int] | None:
        """A constant integer input (shape, axes, starts ...) as a list."""
        t = self.input(index)
        return None if t is None else [int(v) for v in t.reshape(-1).tolist()]

    @property
    def n_outputs(self) -> int:
        return int(self.attrs.get("_outputs", 1))


OpFn = Callable[[Call], Sequence[Tensor]]
TORCH_OPS: dict[str, OpFn] = {}


def op(*names: str) -> Callable[[OpFn], OpFn]:
    def deco(fn: OpFn) -> OpFn:
        for n in names:
            TORCH_OPS[n] = fn
        return fn
    return deco


def _x(c: Call, i: int = 0) -> Tensor:
    t = c.inputs[i]
    assert t is not None
    return t


def onnx_pads(c: Call, x: Tensor, kernel: Sequence[int], strides: Sequence[int] | None = None,
              dilations: Sequence[int] | None = None) -> list[int]:
    """The node's pads in ONNX order ([x1_begin, ..., x1_end, ...]), ``auto_pad`` SAME_UPPER /
    SAME_LOWER resolved against the input's spatial shape."""
    spatial = len(kernel)
    auto = c.attr("auto_pad", "NOTSET")
    if auto in ("NOTSET", "VALID"):
        return [0] * (2 * spatial) if auto == "VALID" else list(c.attr("pads", [0] * (2 * spatial)))
    strides = list(strides or c.attr("strides", [1] * spatial))
    dilations = list(dilations or c.attr("dilations", [1] * spatial))
    begin, end = [], []
    for d in range(spatial):
        size = x.shape[2 + d]
        out = math.ceil(size / strides[d])
        total = max(0, (out - 1) * strides[d] + (kernel[d] - 1) * dilations[d] + 1 - size)
        small, big = total // 2, total - total // 2
        b, e = (small, big) if auto == "SAME_UPPER" else (big, small)
        begin.append(b)
        end.append(e)
    return begin + end


def torch_pads(pads: Sequence[int]) -> list[int]:
    """ONNX pads ([x1_begin, x2_begin, ..., x1_end, x2_end]) as F.pad wants them: last axis first."""
    n = len(pads) // 2
    out: list[int] = []
    for d in reversed(range(n)):
        out += [int(pads[d]), int(pads[d + n])]
    return out


def _pads(c: Call, spatial: int, x: Tensor | None = None, kernel: Sequence[int] | None = None) -> list[int]:
    """F.pad-ordered spatial pads of a conv / pool node."""
    if x is None or kernel is None:
        if c.attr("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
            raise NotImplementedError(f"auto_pad {c.attr('auto_pad')}")
        return torch_pads(list(c.attr("pads", [0] * (2 * spatial))) if c.attr("auto_pad", "NOTSET") == "NOTSET"
                          else [0] * (2 * spatial))
    return torch_pads(onnx_pads(c, x, kernel))


def axis_list(c: Call, x: Tensor, index: int = 1) -> list[int] | None:
    """Axes from the ``axes`` attribute or the input at ``index`` (later opsets), normalised; None if absent."""
    axes = c.attr("axes")
    if axes is None:
        axes = c.ints(index)
    return None if axes is None else [int(a) % max(1, x.dim()) for a in axes]
