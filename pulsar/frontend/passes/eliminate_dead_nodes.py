"""Remove nodes, initializers and value_info that no graph output depends on.

Folding and BN fusion leave orphaned weights and subgraphs behind; keeping them would bloat the
artifact and make the quantizer calibrate tensors nobody reads. Graph inputs are kept even if
unused: they are the model's interface.
"""

from __future__ import annotations

import onnx

from pulsar.frontend.graph import node_inputs, output_names, remove_nodes, tensor_names
from pulsar.frontend.passes.registry import register_pass


@register_pass("eliminate_dead_nodes")
def eliminate_dead_nodes(model: onnx.ModelProto) -> bool:
    graph = model.graph
    live = set(output_names(graph))
    dead = []
    for node in reversed(graph.node):  # nodes are topologically sorted
        if any(o in live for o in node.output if o):
            live.update(node_inputs(node))
        else:
            dead.append(node)
    changed = remove_nodes(graph, dead) > 0

    unused = [t for t in graph.initializer if t.name not in live]
    if unused:
        names = {t.name for t in unused}
        for i in reversed(range(len(graph.initializer))):  # in place: re-adding the kept ones would copy them
            if graph.initializer[i].name in names:
                del graph.initializer[i]
        # Old IR versions (and torch's keep_initializers_as_inputs) list weights as inputs too.
        inputs = [i for i in graph.input if i.name not in names]
        if len(inputs) != len(graph.input):
            del graph.input[:]
            graph.input.extend(inputs)
        changed = True
    sparse = [t for t in graph.sparse_initializer if t.values.name not in live]
    if sparse:
        kept_sparse = [t for t in graph.sparse_initializer if t.values.name in live]
        del graph.sparse_initializer[:]
        graph.sparse_initializer.extend(kept_sparse)
        changed = True

    defined = tensor_names(graph)
    value_info = [vi for vi in graph.value_info if vi.name in defined]
    if len(value_info) != len(graph.value_info):
        del graph.value_info[:]
        graph.value_info.extend(value_info)
        changed = True
    return changed
