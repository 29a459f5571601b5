"""Attention masks: where a BERT-style model adds a huge negative number to the attention scores.

Why it matters: the masked ``Add`` (scores + mask) before a Softmax holds the mask's -1e4 .. -3.4e38
next to scores of a few units. Quantized on one grid, every real score falls into a single step and
the Softmax after it turns uniform (an all-MiniLM-L6-v2 sentence embedding drops to cosine 0.37
with float). The additive mask only ever says "leave this position out", so pulsar:

- adds the mask in float, together with the float branch that builds it from the model's inputs
  (Cast / Unsqueeze / Sub / Mul / Where ...): those ops stay on the CPU with the Softmax when the
  Softmax is float (transformer_opt_level 0), and the scores before the Add are quantized over their
  own range, which never holds the mask;
- when the Softmax runs on the NPU (levels 1, 2), the masked scores it reads are quantized over the
  scores' own range widened below by :data:`MASK_MARGIN`: a masked position saturates at the bottom
  of the grid, ``exp(-MASK_MARGIN)`` below every unmasked score of its row, which is what the mask
  means, instead of stretching the grid over 1e38.

Recognised masks, all ending in the ``Add`` / ``Sub`` / ``Where`` whose result reaches a Softmax
through shape-only ops: an additive mask computed from graph inputs and constants only (no weighted
or attention op above it) whose branch holds a constant at or below :data:`LARGE_NEGATIVE` (HF's
``(1 - mask) * finfo.min``, ``* -10000``, a ``Where(mask == 0, -inf, 0)``), a float mask that is a
model input (or made from ones no other op reads) added to computed scores, a constant mask tensor
such as a baked causal mask, and a boolean masked fill ``Where(cond, scores, -big)``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

import numpy as np
import onnx
from onnx import numpy_helper

from pulsar.core import opdefs

LARGE_NEGATIVE = -1e4  # a mask constant at or below this is a mask, not a bias (HF: -1e4, finfo.min, -inf)
MASK_MARGIN = 20.0  # masked scores sit this far below the scores' range: exp(-20) = 2e-9 of a row's weight
SHAPE_OPS = opdefs.shape_only_ops()  # what may sit between a mask application and its Softmax
SOFTMAX_OPS = opdefs.kind_ops("softmax")
# Ops that read input 0 at run-time positions: compute when input 0 is a learned table (see _Graph.computes).
_INDEXING = opdefs.kind_ops("gather")
# Ops that never belong to a mask branch: they compute on learned or data activations (products,
# attention, normalizations, softmaxes, and the GELUs of transformer blocks).
_COMPUTE = opdefs.kind_ops("conv", "matmul", "attention", "normalization", "softmax") \
    | opdefs.npu_manual_nonlinearities()


@dataclass(frozen=True)
class MaskedScores:
    """One masked score tensor: ``node`` combines ``scores`` with the mask; ``branch`` builds the mask."""

    node: str
    scores: str
    output: str
    branch: tuple[str, ...]
    mask: str | None = None  # the additive mask tensor (None: a masked fill by Where)
    path: tuple[str, ...] = ()  # the tensors from ``output`` to the Softmax input (``output`` first)


class _Graph:
    def __init__(self, model: onnx.ModelProto) -> None:
        g = model.graph
        self.maker: dict[str, onnx.NodeProto] = {o: n for n in g.node for o in n.output if o}
        self.readers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for n in g.node:
            for i in n.input:
                self.readers[i].append(n)
        # the constants as protos, read as arrays when asked (a BERT's 90 MB of weights took 0.08 s)
        self.consts: dict[str, onnx.TensorProto] = {t.name: t for t in g.initializer}
        self._extremes: dict[str, float] = {}
        self.float_inputs = {v.name for v in g.input if v.name not in self.consts
                             and v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}
        for n in g.node:
            if n.op_type == "Constant" and n.output:
                for a in n.attribute:
                    if a.name == "value":
                        self.consts[n.output[0]] = a.t

    def large_negative(self, name: str) -> bool:
        return self.extreme(name) <= LARGE_NEGATIVE

    def extreme(self, name: str) -> float:
        """The constant's value farthest from 0, signed (0 for a non-constant or a non-float one)."""
        if name in self._extremes:
            return self._extremes[name]
        proto = self.consts.get(name)
        v = numpy_helper.to_array(proto) if proto is not None else None
        got = 0.0
        if v is not None and v.dtype.kind == "f" and v.size:
            lo, hi = float(np.min(v)), float(np.max(v))
            got = lo if -lo >= hi else hi
        self._extremes[name] = got
        return got

    def branch(self, tensor: str, sign: float = -1.0) -> tuple[list[str], bool] | None:
        """The nodes that compute ``tensor`` from inputs and constants, and whether a constant of
        magnitude >= -LARGE_NEGATIVE and of ``sign`` takes part; None when a compute op (weights,
        attention) is among them."""
        nodes: list[str] = []
        seen: set[str] = set()
        large = self.extreme(tensor) * sign >= -LARGE_NEGATIVE
        stack = [tensor]
        while stack:
            t = stack.pop()
            n = self.maker.get(t)
            if n is None or n.name in seen:
                continue
            if self.computes(n) or len(seen) > 64:
                return None
            seen.add(n.name)
            nodes.append(n.name)
            for i in n.input:
                large = large or self.extreme(i) * sign >= -LARGE_NEGATIVE
                stack.append(i)
        return nodes, large

    def computes(self, n: onnx.NodeProto) -> bool:
        """A compute op (weights, attention). A Gather from a run-time tensor is indexing, as HF's
        mask code does on the attention mask, not an embedding lookup in a learned table."""
        if n.op_type in _INDEXING:
            return bool(n.input) and n.input[0] in self.consts
        return n.op_type in _COMPUTE

    def mask_input(self, tensor: str) -> bool:
        """``tensor`` is a float graph input, or made from them by mask-branch ops (no compute op), and
        no compute op reads those inputs: an input that also feeds the network (``Softmax(x @ W + x)``)
        is data, not a mask; one a ReduceMax also reads (fully masked rows) still is a mask."""
        found = self.branch(tensor)
        if found is None:
            return False
        nodes = set(found[0])
        leaves = {tensor} if tensor in self.float_inputs else set()
        leaves |= {i for n in self.nodes_named(nodes) for i in n.input if i in self.float_inputs}
        return bool(leaves) and not any(self.computes(r) for t in leaves for r in self.readers[t])

    def nodes_named(self, names: set[str]) -> list[onnx.NodeProto]:
        return [n for n in self.maker.values() if n.name in names]

    def path_to_softmax(self, tensor: str, through: set[str]) -> list[str] | None:
        """The tensors from ``tensor`` to a Softmax's input through shape-only ops and the mask
        applications ``through`` (stacked masks: causal then padding), or None when none is reached."""
        stack: list[tuple[str, list[str]]] = [(tensor, [tensor])]
        seen: set[str] = set()
        while stack:
            t, path = stack.pop()
            for r in self.readers.get(t, []):
                if r.op_type in SOFTMAX_OPS and r.input[0] == t:
                    return path
                passes = (r.op_type in SHAPE_OPS and r.input[0] == t) or r.name in through
                if passes and r.name not in seen and r.output:
                    seen.add(r.name)
                    stack.append((r.output[0], [*path, r.output[0]]))
        return None


def _candidate(g: _Graph, node: onnx.NodeProto) -> MaskedScores | None:
    ins = list(node.input)
    if node.op_type == "Where" and len(ins) == 3:
        for keep, fill in ((1, 2), (2, 1)):
            if g.large_negative(ins[fill]) and ins[keep] not in g.consts:
                cond = g.branch(ins[0])
                if cond is not None:
                    return MaskedScores(node.name, ins[keep], node.output[0], tuple(cond[0]))
        return None
    sides = ((0, 1), (1, 0)) if node.op_type == "Add" else ((0, 1),) if node.op_type == "Sub" else ()
    for s, m in sides:
        if ins[s] in g.consts:
            continue
        found = g.branch(ins[m], -1.0 if node.op_type == "Add" else 1.0)
        # a float mask fed as a model input (values unknown at build time: HF-style -1e4 / -inf rows)
        fed = node.op_type == "Add" and found is not None and g.mask_input(ins[m]) and g.branch(ins[s]) is None
        if found is not None and (found[1] or fed):
            if node.op_type == "Add":  # scores - mask would need a positive mask: not a form exporters write
                return MaskedScores(node.name, ins[s], node.output[0], tuple(found[0]), ins[m])
            return MaskedScores(node.name, ins[s], node.output[0], tuple(found[0]))
    return None


def masked_scores(model: onnx.ModelProto) -> list[MaskedScores]:
    """Every attention mask application of ``model`` (see the module docstring), in graph order."""
    g = _Graph(model)
    found = {n.name: c for n in model.graph.node if n.op_type in ("Add", "Sub", "Where") and n.output
             and (c := _candidate(g, n)) is not None}
    out = []
    for c in found.values():
        path = g.path_to_softmax(c.output, set(found))
        if path is not None:
            out.append(replace(c, path=tuple(path)))
    return out


def true_scores(masks: list[MaskedScores], m: MaskedScores) -> str:
    """The scores under ``m`` before any other mask was applied (stacked masks)."""
    by_output = {x.output: x for x in masks}
    scores, seen = m.scores, {m.output}
    while scores in by_output and scores not in seen:
        seen.add(scores)
        scores = by_output[scores].scores
    return scores


def masked_range(scores: tuple[float, float]) -> tuple[float, float]:
    """The grid of masked scores: the scores' own range, widened below so a masked position saturates
    :data:`MASK_MARGIN` under the lowest real score (and the grid still holds 0)."""
    lo, hi = scores
    return min(lo - MASK_MARGIN, 0.0), max(hi, 0.0)
