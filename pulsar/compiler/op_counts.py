"""NPU / CPU op counts after lowering, reconciled with the quantization placement.

The quant stage counts the ops of the float graph it placed ("placement: 203 of 216 ops on the
NPU"); the compiler lowers a different graph: the QDQ model with the input / output processors in
front of and behind it, where Q / DQ nodes sit at every NPU border, several model ops can become one
integer op (a Conv and its Relu) and one model op several (a Concat requantizing its inputs). So the
compiler counts the same model ops the placement counted and names every difference:

- a model op the compiler runs somewhere else than it was placed, with the reason (a fallback's
  reason, or a CPU-placed op whose inputs and outputs are quantized anyway);
- processor ops, which are not model ops (they are counted apart);
- per subgraph, the ops of its body against the model ops it computes: Q / DQ at the borders,
  model ops fused into one integer op or lowered to several.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import onnx

from pulsar.compiler.lower import LoweredModel

_QDQ = ("QuantizeLinear", "DequantizeLinear")


@dataclass
class Move:
    """Model ops of one type placed on one device by quantization and run on the other."""

    op_type: str
    to: str  # "NPU" | "CPU"
    reason: str
    nodes: list[str] = field(default_factory=list)


@dataclass
class SubgraphCount:
    name: str
    kind: str
    ops: int                 # nodes of its body (integer ops for an NPU subgraph)
    model_ops: int           # model (float graph) ops it computes
    notes: list[str] = field(default_factory=list)  # why ``ops`` differs from ``model_ops``


@dataclass
class OpCounts:
    model_ops: int
    placed_npu: int          # model ops the quant stage placed on the NPU
    npu: int                 # model ops on the NPU after lowering
    moves: list[Move]
    processor_ops: dict[str, Counter[str]]  # "input" / "output" -> Counter(op type) (all on the CPU or NPU)
    processor_npu: Counter[str]  # "input" / "output" -> processor ops on the NPU
    subgraphs: list[SubgraphCount]

    @property
    def cpu(self) -> int:
        return self.model_ops - self.npu

    def headline(self) -> str:
        """One line: the lowered counts next to the placement's, with every difference's reason."""
        text = f"{self.npu} of {self.model_ops} model ops on the NPU, {self.cpu} on the CPU"
        if not self.moves:
            text += " (as placed by quantization)"
        else:
            text += f" (placement: {self.placed_npu} on the NPU; " + "; ".join(
                f"{'+' if m.to == 'NPU' else '-'}{len(m.nodes)} {m.op_type} {m.reason}" for m in self.moves) + ")"
        for side, ops in self.processor_ops.items():
            if ops:
                total = sum(ops.values())
                on_npu = self.processor_npu[side]
                where = "on the CPU" if not on_npu else "on the NPU" if on_npu == total else f"{on_npu} on the NPU"
                text += (f"; {side} processors add {total} op{'s' if total > 1 else ''} ({_types(ops)}), "
                         f"{where}, not counted as model ops")
        return text

    def to_json(self) -> dict[str, Any]:
        return {
            "model_ops": self.model_ops, "placed_npu": self.placed_npu, "npu": self.npu, "cpu": self.cpu,
            "moved": [{"op_type": m.op_type, "to": m.to, "count": len(m.nodes), "nodes": m.nodes, "reason": m.reason}
                      for m in self.moves],
            "processor_ops": {k: dict(v) for k, v in self.processor_ops.items() if v},
            "subgraphs": [{"name": s.name, "kind": s.kind, "ops": s.ops, "model_ops": s.model_ops, "notes": s.notes}
                          for s in self.subgraphs],
        }


def _types(ops: Counter[str]) -> str:
    return ", ".join(f"{t}" if n == 1 else f"{n} {t}" for t, n in ops.most_common())


def _moved_reason(to: str, fallback: str | None) -> str:
    if to == "CPU":
        return f"kept on the CPU by the compiler: {fallback or 'no NPU lowering'}"
    return "lowered to the NPU by the compiler"  # ops placed on the CPU are kept there (LowerOptions.cpu_nodes)


def _subgraph_counts(lowered: LoweredModel, model_ops: set[str]) -> list[SubgraphCount]:
    out = []
    for sg in lowered.subgraphs:
        body = list(sg.graph.node)
        if sg.kind == "npu":
            ops = lowered.ops.get(sg.name, [])
            patterns: Counter[str] = Counter()
            for op in ops:
                if len(op.op_types) != len(op.integer_ops):
                    patterns[f"{'+'.join(op.op_types)} -> {'+'.join(op.integer_ops)}"] += 1
            n_model = sum(len(op.nodes) for op in ops)
            notes = [f"{p}{f' (x{n})' if n > 1 else ''}" for p, n in patterns.most_common()]
            out.append(SubgraphCount(sg.name, sg.kind, len(body), n_model, notes))
            continue
        kinds = Counter("model" if n.name in model_ops else n.op_type if n.op_type in _QDQ else "processor"
                        for n in body)
        notes = [f"{kinds[q]} {q} at the NPU borders" for q in _QDQ if kinds[q]]
        if kinds["processor"]:
            notes.append(f"{kinds['processor']} processor op{'s' if kinds['processor'] > 1 else ''}")
        out.append(SubgraphCount(sg.name, sg.kind, len(body), kinds["model"], notes))
    return out


def reconcile(lowered: LoweredModel, qmodel: onnx.ModelProto, deployed: onnx.ModelProto,
              placement: dict[str, tuple[str, str]] | None) -> OpCounts:
    """Count the lowered model's ops against ``placement`` (node -> (NPU | CPU, why), the quant stage's,
    from quant_config.json; None: every QDQ compute op is a model op placed where it was lowered).

    ``qmodel`` is the QDQ model the quant stage wrote, ``deployed`` the same with processors attached."""
    processors = processor_side(qmodel, deployed)
    fallbacks = {f.node: f.reason for f in lowered.fallbacks}
    if placement is None:
        placement = {n: (k.upper(), "") for n, k in lowered.placement.items() if n not in processors}
    moves: dict[tuple[str, str, str], Move] = {}
    npu = 0
    op_type = {n.name: n.op_type for n in deployed.graph.node}
    for node, (device, _why) in placement.items():
        lowered_on = lowered.placement.get(node, device.lower()).upper()
        npu += lowered_on == "NPU"
        if lowered_on != device:
            reason = _moved_reason(lowered_on, fallbacks.get(node))
            key = (op_type.get(node, "?"), lowered_on, reason)
            moves.setdefault(key, Move(*key)).nodes.append(node)
    proc_ops: dict[str, Counter[str]] = {"input": Counter(), "output": Counter()}
    proc_npu: Counter[str] = Counter()
    for node, side in processors.items():
        if node in lowered.placement:
            proc_ops[side][op_type[node]] += 1
            proc_npu[side] += lowered.placement[node] == "npu"
    placed_npu = sum(d == "NPU" for d, _ in placement.values())
    return OpCounts(len(placement), placed_npu, npu, sorted(moves.values(), key=lambda m: (-len(m.nodes), m.op_type)),
                    proc_ops, proc_npu, _subgraph_counts(lowered, set(placement)))


def count_rows(counts: OpCounts) -> list[tuple[str, str, str, str]]:
    """Placement counts, each difference with its reason, the lowered counts, then the processor ops."""
    rows = [("placed by quantization", str(counts.placed_npu), str(counts.model_ops - counts.placed_npu),
             "the 'Ops on the CPU' table; per node in quant/quant_config.json")]
    for m in counts.moves:
        n = len(m.nodes)
        npu, cpu = (f"+{n}", f"-{n}") if m.to == "NPU" else (f"-{n}", f"+{n}")
        rows.append((f"{m.op_type} ({', '.join(m.nodes[:3])}{', ...' if n > 3 else ''})", npu, cpu, m.reason))
    rows.append(("after lowering", str(counts.npu), str(counts.cpu), f"of {counts.model_ops} model ops"))
    for side, ops in counts.processor_ops.items():
        total = sum(ops.values())
        if total:
            on_npu = counts.processor_npu[side]
            rows.append((f"{side} processor ops", str(on_npu), str(total - on_npu),
                         f"{_types(ops)}: added by {side}_processors, not model ops"))
    return rows


def subgraph_rows(counts: OpCounts) -> list[tuple[str, str, str, str]]:
    """(subgraph, ops in its body, model ops it computes, why they differ) rows in execution order."""
    return [(s.name, str(s.ops), str(s.model_ops), "; ".join(s.notes) or "-") for s in counts.subgraphs]


def processor_reason(side: str) -> str:
    """Why a processor op runs where the compiler put it (the generic fallback reasons name layer_configs,
    which cannot select processor ops)."""
    if side == "input":
        return "input_processors step: preprocessing runs in float before the model input is quantized"
    return "output_processors step: runs after the model output is dequantized"


def processor_side(qmodel: onnx.ModelProto, deployed: onnx.ModelProto) -> dict[str, str]:
    """Processor node -> "input" / "output"."""
    own = {n.name for n in qmodel.graph.node}
    first = next((i for i, n in enumerate(deployed.graph.node) if n.name in own), 0)
    return {n.name: ("input" if i < first else "output") for i, n in enumerate(deployed.graph.node)
            if n.name not in own}
