"""16 bits where they carry something: a table or a data move with a 16-bit output reads 16 bits.

A Sigmoid / Tanh / ... whose output is stored at 16 bits (a join of unlike ranges or a heavy-tailed
output raised it) but whose input stays 8-bit has at most 256 distinct outputs: the 16 bits carry
nothing. A detector's class scores are the case: the scores join pixel boxes at U16, while the
logits before their Sigmoid sit on an 8-bit grid shared with the box-distribution logits (step 0.11:
scores near a 0.25 threshold move by 0.01 and boxes appear or vanish). So the input is raised too,
and with it everything that only moves, joins or maps its values up to the op that computes them: the
passive ops, Concats and tables on the way (a Reshape writing 16 bits of an 8-bit tensor holds 8
bits too), ending at the compute op whose output is then requantized to 16 bits from its
accumulator. Tensors a layer_configs entry set stay as set.
"""

from __future__ import annotations

import logging
from collections.abc import Set as AbstractSet

import onnx

from pulsar.quant.ops import OPS, UNARY_LUT_OPS
from pulsar.quant.plan import QuantPlan
from pulsar.quant.scheme import BITS

log = logging.getLogger(__name__)

WIDER = {"U8": "U16", "S8": "S16"}
# ops that only move or assemble values: a 16-bit reader's need flows through them to their inputs
CARRIERS = frozenset(op for op, r in OPS.items() if r.passive) | {"Concat"}


def widen_table_inputs(model: onnx.ModelProto, plan: QuantPlan, fixed: AbstractSet[str] = frozenset()) -> list[str]:
    """Raise, in ``plan``, the 8-bit inputs of 16-bit lookup tables (and what carries them) to 16 bits."""
    producer = {o: n for n in model.graph.node for o in n.output if o}
    quantized = set(plan.quantized_nodes)
    # a table or a carrier writing 16 bits from an 8-bit input: the extra bits hold nothing yet
    stack = [i for n in model.graph.node if (n.op_type in UNARY_LUT_OPS or n.op_type in CARRIERS)
             and n.name in quantized and n.output and BITS.get(plan.dtypes.get(n.output[0], ""), 0) == 16
             for i in (n.input[:1] if n.op_type in UNARY_LUT_OPS or n.op_type != "Concat" else n.input)
             if plan.dtypes.get(i) in WIDER]
    raised: list[str] = []
    seen: set[str] = set()
    while stack:
        t = stack.pop()
        if t in seen or t in fixed:
            continue
        seen.add(t)
        if plan.dtypes.get(t) in WIDER:
            plan.dtypes[t] = WIDER[plan.dtypes[t]]
            raised.append(t)
        node = producer.get(t)
        if node is not None and node.name in quantized and (node.op_type in CARRIERS or node.op_type in UNARY_LUT_OPS):
            stack.extend(i for i in (node.input if node.op_type == "Concat" else node.input[:1]) if i in plan.dtypes)
    if raised:
        for out, src in plan.shared.items():  # passive outputs sharing a raised grid follow it
            if plan.dominator(src) in raised and plan.dtypes.get(out) in WIDER:
                plan.dtypes[out] = plan.dtypes[plan.dominator(src)]
        plan.shared = {o: i for o, i in plan.shared.items() if plan.dtypes.get(o) == plan.dtypes.get(i)}
        log.info("table inputs: %d tensors feeding 16-bit lookup tables raised to 16 bits (%s%s)", len(raised),
                 ", ".join(raised[:3]), " ..." if len(raised) > 3 else "")
    return raised
