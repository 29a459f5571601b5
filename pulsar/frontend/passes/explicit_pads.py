"""``auto_pad`` (SAME_UPPER / SAME_LOWER / VALID) -> explicit ``pads`` once the input shape is known.

PaddlePaddle and TF exports write pooling and convolutions with ``auto_pad``; with static shapes it is
an ordinary padding, and every later stage (Pad folding, the torch executor of fine-tuning, the NPU
lowering of a passive MaxPool) then handles one form instead of two. A model with a dynamic spatial
size keeps its ``auto_pad``.
"""

from __future__ import annotations

import onnx
from onnx import helper

from pulsar.core.padding import auto_pads
from pulsar.frontend.graph import DEFAULT_DOMAINS, attr, dims_of
from pulsar.frontend.passes.registry import register_pass
from pulsar.frontend.shapes import inferred_graph

WINDOW_OPS = frozenset({"Conv", "MaxPool", "AveragePool", "LpPool"})


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@register_pass("explicit_pads")
def explicit_pads(model: onnx.ModelProto) -> bool:
    nodes = [n for n in model.graph.node if n.op_type in WINDOW_OPS and n.domain in DEFAULT_DOMAINS
             and _text(attr(n, "auto_pad", b"NOTSET")) != "NOTSET"]
    if not nodes:
        return False
    g = inferred_graph(model)
    dims = {vi.name: dims_of(vi) for vi in [*g.input, *g.value_info, *g.output]}
    dims.update({t.name: list(t.dims) for t in model.graph.initializer})
    changed = False
    for n in nodes:
        x = dims.get(n.input[0])
        if n.op_type == "Conv":
            w = dims.get(n.input[1]) if len(n.input) > 1 else None
            kernel = list(attr(n, "kernel_shape", None) or (w[2:] if w else []))
        else:
            kernel = list(attr(n, "kernel_shape", []))
        if not x or not kernel or len(x) != len(kernel) + 2 or not all(isinstance(d, int) and d > 0 for d in x[2:]) \
                or not all(isinstance(k, int) and k > 0 for k in kernel):
            continue
        rank = len(kernel)
        strides = list(attr(n, "strides", None) or [1] * rank)
        dilations = list(attr(n, "dilations", None) or [1] * rank)
        spatial = [int(d) for d in x[2:] if isinstance(d, int)]
        pads = auto_pads(_text(attr(n, "auto_pad")), spatial, kernel, strides, dilations)
        kept = [a for a in n.attribute if a.name not in ("auto_pad", "pads")]
        del n.attribute[:]
        n.attribute.extend(kept)
        n.attribute.append(helper.make_attribute("pads", pads))
        changed = True
    return changed
