"""Give Range the scalars its spec asks for: a one-element [1] input gets a Squeeze.

Exporters (and ONNX's own function expansions, e.g. AffineGrid's) feed Range one-element 1-D
tensors. onnxruntime's kernel takes them, but its shape inference refuses a Range whose input is
*known* to be [1]: once constant folding makes such a shape known, a model that ran before no longer
loads. Squeezing the input to a scalar is what the spec says and runs the same everywhere.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from pulsar.frontend.graph import TypeInfo, all_node_names, unique_name
from pulsar.frontend.passes.registry import register_pass


@register_pass("scalar_range_inputs")
def scalar_range_inputs(model: onnx.ModelProto) -> bool:
    g = model.graph
    if not any(n.op_type == "Range" for n in g.node):
        return False
    info = TypeInfo.infer(model)
    targets = [(n, k) for n in g.node if n.op_type == "Range" for k, t in enumerate(n.input)
               if t and info.shape.get(t) == (1,)]
    if not targets:
        return False
    taken = {t.name for t in g.initializer} | {o for n in g.node for o in n.output} | {i.name for i in g.input}
    names = set(all_node_names(g))
    axes = unique_name("scalar_range_axes", taken)
    taken.add(axes)
    g.initializer.append(numpy_helper.from_array(np.array([0], np.int64), axes))
    for node, k in targets:
        out = unique_name(f"{node.input[k]}_scalar", taken)
        taken.add(out)
        name = unique_name(f"{node.name}_squeeze{k}", names)
        names.add(name)
        index = list(g.node).index(node)
        g.node.insert(index, helper.make_node("Squeeze", [node.input[k], axes], [out], name=name))
        node.input[k] = out
    return True
