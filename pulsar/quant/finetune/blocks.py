"""Cut the graph into single-entry single-exit blocks for block-wise reconstruction.

A cut is a point of the (topologically ordered) graph where exactly one activation is live: every
later node reads only it and constants, so a block between two cuts has one input and one output and
a residual branch never crosses a cut. Segments between cuts are grouped greedily into blocks of at
most ``size`` weighted layers; a segment holding more (a transformer layer, a wide residual group)
is a block of its own, since it cannot be cut.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx


@dataclass
class Block:
    nodes: list[int]                       # node indices, graph order
    inputs: list[str]
    outputs: list[str]
    weights: list[str] = field(default_factory=list)       # trainable weights read by the block
    weighted_nodes: list[str] = field(default_factory=list)  # output tensor of each weighted layer
    reason: str = ""                       # why the block cannot train (no gradient reaches a weight)


def _cuts(model: onnx.ModelProto) -> tuple[list[int], list[set[str]]]:
    """Node indices after which one activation is live, and the live set after every node."""
    g = model.graph
    consts = {t.name for t in g.initializer} | {o for n in g.node if n.op_type == "Constant" for o in n.output}
    last_use: dict[str, int] = {}
    for i, n in enumerate(g.node):
        for t in n.input:
            if t and t not in consts:
                last_use[t] = i
    end = len(g.node)
    for o in g.output:
        last_use[o.name] = end
    live = {i.name for i in g.input if i.name not in consts and i.name in last_use}
    cuts, lives = [], []
    for i, n in enumerate(g.node):
        live |= {o for o in n.output if o and o in last_use and o not in consts}
        live = {t for t in live if last_use[t] > i}
        lives.append(set(live))
        if len(live) == 1 and i < end - 1:
            cuts.append(i)
    return cuts, lives


def make_blocks(model: onnx.ModelProto, weights: dict[str, str], size: int) -> list[Block]:
    """Blocks of at most ``size`` weighted layers. ``weights``: weight tensor -> node name reading it."""
    g = model.graph
    consts = {t.name for t in g.initializer}
    cuts, lives = _cuts(model)
    bounds = [*cuts, len(g.node) - 1]
    weighted = {node for node in weights.values()}
    segments: list[list[int]] = []
    start = 0
    for b in bounds:
        segments.append(list(range(start, b + 1)))
        start = b + 1

    def count(seg: list[int]) -> int:
        return sum(1 for i in seg if g.node[i].name in weighted)

    groups: list[list[int]] = []
    current: list[int] = []
    for seg in segments:
        if current and count(current) and count(current) + count(seg) > size:
            groups.append(current)
            current = []
        current = current + seg
    if current:
        if groups and not count(current):
            groups[-1] += current   # a tail without weights joins the last block
        else:
            groups.append(current)
    blocks = []
    inputs = [i.name for i in g.input if i.name not in consts]
    by_node = {v: k for k, v in weights.items()}
    for nodes in groups:
        last = nodes[-1]
        outputs = sorted(lives[last]) if last < len(g.node) - 1 else [o.name for o in g.output]
        ws = [by_node[g.node[i].name] for i in nodes if g.node[i].name in by_node]
        wnodes = [g.node[i].output[0] for i in nodes if g.node[i].name in by_node]
        blocks.append(Block(nodes, inputs, outputs, ws, wnodes))
        inputs = outputs
    return blocks
