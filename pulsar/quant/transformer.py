"""``quant.transformer_opt_level`` presets: what a transformer's layers get before any layer_configs entry.

Every level:

- attention masks are added in float (:mod:`pulsar.quant.attention`);
- the residual stream and the matrix products of each block run on 16-bit activations (U16; weights
  stay S8). A block is what lies between two LayerNormalizations; the stream is every Add that feeds
  a LayerNormalization, the LayerNormalization outputs, and the MatMul / Gemm (with their bias Add)
  between them. Why: a trained transformer's residual stream carries a few channels tens of times
  larger than the rest (the LayerNorm outliers); on an 8-bit grid sized for them the other channels
  keep 2-3 levels, and each LayerNorm scales that error back up. Measured on all-MiniLM-L6-v2
  (mask in float): all 8-bit gives embedding cosine 0.81 with float, the stream alone at 16 bits
  0.99, the stream and the products 0.999; the Softmax and GELU outputs at 16 bits add nothing.

Level 1 also moves LayerNormalization, Softmax and GELU to the NPU at U16 (level 0 keeps them in
float on the CPU); level 2 also the activation x activation MatMuls of attention (Q.K^T, P.V).
"""

from __future__ import annotations

from collections import defaultdict

import onnx

from pulsar.core import opdefs
from pulsar.quant.attention import SOFTMAX_OPS, masked_scores
from pulsar.quant.precision import NodePrecision

MASK_REASON = ("attention mask: added in float so the scores keep their own range (a layer_configs entry "
               "naming the node quantizes it)")
STREAM_REASON = "transformer residual stream / block product: U16 (transformer presets)"
# LayerNormalization, Softmax, Gelu, FastGelu: the manual nonlinearities the NPU runs (pulsar/core/opdefs.py)
TRANSFORMER_NORM_OPS = opdefs.npu_manual_nonlinearities()
# MatMul, Gemm: the matrix products pulsar quantizes (a transformer block's linear layers)
PRODUCT_OPS = opdefs.op_types(lambda d: d.kind == "matmul" and d.role == "active")
# what may sit between Q.K^T and its Softmax: scaling, masks, bias (Add / Sub / Mul / Div, Where), shape ops
_SCORE_PATH = opdefs.scalar_arithmetic_ops() | opdefs.kind_ops("select") | opdefs.shape_only_ops()


def transformer_stream(model: onnx.ModelProto) -> list[str]:
    """The residual stream and block products of every transformer block (see the module docstring)."""
    g = model.graph
    maker = {o: n for n in g.node for o in n.output if o}
    readers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for n in g.node:
        for i in n.input:
            readers[i].append(n)
    norms = [n for n in g.node if n.op_type == "LayerNormalization"]
    if len(norms) < 2 or not has_attention(model):
        return []  # LayerNorms around convolutions (ConvNeXt, an embedding head) are not a transformer
    after: set[str] = set()  # nodes downstream of a LayerNormalization
    stack = [o for n in norms for o in n.output]
    while stack:
        for r in readers.get(stack.pop(), []):
            if r.name not in after:
                after.add(r.name)
                stack.extend(r.output)
    before: set[str] = set()  # nodes upstream of a LayerNormalization
    stack = [n.input[0] for n in norms]
    while stack:
        m = maker.get(stack.pop())
        if m is not None and m.name not in before:
            before.add(m.name)
            stack.extend(m.input)
    body = after & before
    stream = {n.name for n in g.node if n.op_type == "LayerNormalization" or (n.op_type == "Add" and any(
        r.op_type == "LayerNormalization" for o in n.output for r in readers.get(o, [])))}
    # what is added into the stream: the branch outputs, the embedding sums
    stream |= {maker[i].name for n in g.node if n.name in stream and n.op_type == "Add" for i in n.input
               if i in maker and maker[i].op_type in ("Add", *PRODUCT_OPS)}
    out = []
    for n in g.node:
        bias_add = n.op_type == "Add" and any(i in maker and maker[i].op_type in PRODUCT_OPS for i in n.input)
        if n.name in stream or (n.name in body and (n.op_type in PRODUCT_OPS or bias_add)):
            out.append(n.name)
    return out


def has_attention(model: onnx.ModelProto) -> bool:
    """A Softmax over the product of two activations (Q.K^T), through scaling, masks and shape ops."""
    g = model.graph
    consts = {t.name for t in g.initializer} | {o for n in g.node if n.op_type == "Constant" for o in n.output}
    maker = {o: n for n in g.node for o in n.output if o}
    for n in g.node:
        if n.op_type not in SOFTMAX_OPS:
            continue
        stack, seen = [(n.input[0], 0)], set()
        while stack:
            t, depth = stack.pop()
            m = maker.get(t)
            if m is None or m.name in seen or depth > 8:
                continue
            seen.add(m.name)
            if m.op_type == "MatMul" and not any(i in consts for i in m.input):
                return True
            if m.op_type in _SCORE_PATH:
                stack.extend((i, depth + 1) for i in m.input if i not in consts)
    return False


def transformer_presets(model: onnx.ModelProto, level: int,
                        default: NodePrecision | None = None) -> dict[str, NodePrecision]:
    """node name -> preset precision for ``transformer_opt_level`` ``level`` (see the module docstring);
    the stream presets only ever raise ``default`` (``highest_mix_precision`` keeps its S16 weights)."""
    default = default or NodePrecision()
    out: dict[str, NodePrecision] = {}
    for m in masked_scores(model):
        for name in (m.node, *m.branch):
            out[name] = NodePrecision("FP32", why=MASK_REASON)
    if default.data_type in ("U8", "S8"):
        stream = default.widened("U16", STREAM_REASON)
        for name in transformer_stream(model):
            out.setdefault(name, stream)
    if level <= 0:
        return out
    inits = {t.name for t in model.graph.initializer}
    for n in model.graph.node:
        attention_matmul = n.op_type == "MatMul" and not any(i in inits for i in n.input)
        if out.get(n.name, NodePrecision()).data_type != "FP32" and (
                n.op_type in TRANSFORMER_NORM_OPS or (level >= 2 and attention_matmul)):
            out[n.name] = NodePrecision("U16", explicit=True)
    return out
