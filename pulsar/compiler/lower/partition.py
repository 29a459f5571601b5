"""Lower a QDQ model into ordered NPU / CPU subgraphs.

Units (see placement.py) are scheduled in a topological order that keeps running the current kind
as long as it can, and every change of kind starts a new subgraph (``npu_0``, ``cpu_0``, ...). NPU
units inside a ``compiler.sub_configs`` range form their own runs (``npu_3_sub0``), never merged with
units outside it, and their subgraph carries the range's options.
Each body is self-contained: graph inputs / outputs are the tensors crossing its border, every
tensor has a value_info, and the initializers it reads are inside (weights keep their QDQ names,
``W/q``, ``B/q``, so the packager stores them once). An NPU subgraph has two bodies with the same
interface: the integer program and the QDQ fragment it replaces (``reference_body``).
"""

from __future__ import annotations

import heapq
import logging
from collections import Counter
from collections.abc import Iterable

import onnx
from onnx import helper, numpy_helper

from pulsar.compiler.lower.model import Fallback, LoweredModel, LoweredOp, LowerOptions
from pulsar.compiler.lower.placement import Unit, place, weight_dq_outputs
from pulsar.compiler.lower.qdq_graph import QdqGraph, TensorType
from pulsar.compiler.lower.rules import INT_DOMAIN
from pulsar.core.container import Subgraph
from pulsar.errors import PulsarError
from pulsar.frontend.graph import node_inputs

log = logging.getLogger(__name__)


def _group(u: Unit) -> tuple[str, int | None]:
    """Units of one group may share a subgraph: same kind and, for NPU units, same sub-config range."""
    return u.kind, u.sub if u.kind == "npu" else None


def schedule(units: list[Unit]) -> list[list[Unit]]:
    """Units grouped into same-group runs (kind, sub-config range), in an order that changes group as
    rarely as it can greedily."""
    producer = {t: i for i, u in enumerate(units) for t in u.makes}
    waiting = [0] * len(units)
    readers: dict[int, list[int]] = {i: [] for i in range(len(units))}
    for i, u in enumerate(units):
        deps = {producer[t] for t in u.needs if t in producer and producer[t] != i}
        waiting[i] = len(deps)
        for d in deps:
            readers[d].append(i)
    ready: dict[tuple[str, int | None], list[tuple[int, int]]] = {_group(u): [] for u in units}
    for i, u in enumerate(units):
        if not waiting[i]:
            heapq.heappush(ready[_group(u)], (u.index, i))
    runs: list[list[Unit]] = []
    group = None
    while any(ready.values()):
        if group is None or not ready[group]:
            groups = [k for k in ready if ready[k] and k != group]
            group = min(groups, key=lambda k: ready[k][0])
            runs.append([])
        _, i = heapq.heappop(ready[group])
        runs[-1].append(units[i])
        for r in readers[i]:
            waiting[r] -= 1
            if not waiting[r]:
                heapq.heappush(ready[_group(units[r])], (units[r].index, r))
    if sum(len(r) for r in runs) != len(units):
        raise ValueError("the QDQ graph could not be scheduled (cycle between units)")
    return runs


def _vi(g: QdqGraph, name: str, override: dict[str, TensorType] | None = None) -> onnx.ValueInfoProto:
    t = (override or {}).get(name) or g.types.get(name)
    if t is None:
        log.debug("no type known for %s", name)
        return helper.make_empty_tensor_value_info(name)
    return helper.make_tensor_value_info(name, t.elem_type, list(t.shape) if t.shape is not None else None)


def _referenced(nodes: Iterable[onnx.NodeProto]) -> list[str]:
    return list(dict.fromkeys(i for n in nodes for i in node_inputs(n)))


def _graph(g: QdqGraph, name: str, nodes: list[onnx.NodeProto], inputs: list[str], outputs: list[str],
           inits: list[onnx.TensorProto], types: dict[str, TensorType] | None = None) -> onnx.GraphProto:
    border = set(inputs) | set(outputs) | {t.name for t in inits}
    internal = [o for n in nodes for o in n.output if o and o not in border]
    return helper.make_graph(
        nodes, name, [_vi(g, i, types) for i in inputs], [_vi(g, o, types) for o in outputs],
        initializer=inits, value_info=[_vi(g, t, types) for t in dict.fromkeys(internal)])


def _qdq_inits(g: QdqGraph, names: Iterable[str]) -> list[onnx.TensorProto]:
    return [g.inits[n] for n in dict.fromkeys(names) if n in g.inits]


def _cpu_body(g: QdqGraph, units: list[Unit], inputs: list[str], outputs: list[str], name: str,
              pulled: set[str]) -> onnx.GraphProto:
    nodes: list[onnx.NodeProto] = []
    added: set[str] = set()
    for u in units:
        for i in node_inputs(u.nodes[0]):
            dq = g.producer.get(i)
            if i in pulled and dq is not None and dq.name not in added:
                nodes.append(dq)
                added.add(dq.name)
        nodes.extend(u.nodes)
    return _graph(g, name, nodes, inputs, outputs, _qdq_inits(g, _referenced(nodes)))


def _npu_bodies(g: QdqGraph, units: list[Unit], inputs: list[str], outputs: list[str],
                name: str) -> tuple[onnx.GraphProto, onnx.GraphProto]:
    nodes: list[onnx.NodeProto] = []
    new_inits: dict[str, onnx.TensorProto] = {}
    shared: list[str] = []
    types: dict[str, TensorType] = {}
    ref_nodes: list[onnx.NodeProto] = []
    added: set[str] = set()
    for u in units:
        assert u.ctx is not None
        nodes.extend(u.ctx.nodes)
        for k, v in u.ctx.inits.items():
            new_inits[k] = numpy_helper.from_array(v, k)
        shared.extend(u.ctx.shared_inits)
        types.update(u.ctx.tensors)
        for dq in u.dq_nodes:
            if dq.name not in added:
                ref_nodes.append(dq)
                added.add(dq.name)
        ref_nodes.extend(u.nodes)
    inits = _qdq_inits(g, shared) + list(new_inits.values())
    body = _graph(g, name, nodes, inputs, outputs, inits, types)
    reference = _graph(g, f"{name}_reference", ref_nodes, inputs, outputs, _qdq_inits(g, _referenced(ref_nodes)))
    return body, reference


def lower_qdq_model(qmodel: onnx.ModelProto, options: LowerOptions | None = None) -> LoweredModel:
    """Partition a QDQ model into NPU subgraphs (integer program + QDQ reference) and CPU subgraphs."""
    options = options or LowerOptions()
    for where, bits in [("", options.lut_items_in_bits)] + [(f"compiler.sub_configs '{s.name}': ", s.lut_items_in_bits)
                                                              for s in options.sub_configs]:
        if bits is not None and not 1 <= int(bits) <= 16:
            raise PulsarError(f"{where}lut_items_in_bits {bits} is out of range; use 1..16 (default 10)")
    g = QdqGraph(qmodel)
    units, fallbacks, placement = place(g, options)
    runs = schedule(units)
    pulled = weight_dq_outputs(g)
    produced_in = [{t for u in run for t in u.makes} for run in runs]
    # tensors each run (or the model's outputs) reads from an earlier run
    later: list[set[str]] = [set() for _ in runs]
    needed_after = set(g.output_names)
    for k in range(len(runs) - 1, -1, -1):
        later[k] = set(needed_after)
        needed_after |= {t for u in runs[k] for t in u.needs}
    subgraphs: list[Subgraph] = []
    references: dict[str, onnx.GraphProto] = {}
    lowered_ops: dict[str, list[LoweredOp]] = {}
    count: Counter[str] = Counter()
    for k, run in enumerate(runs):
        kind, sub = _group(run[0])
        name = f"{kind}_{count[kind]}" + (f"_{options.sub_configs[sub].name}" if sub is not None else "")
        count[kind] += 1
        inputs = list(dict.fromkeys(t for u in run for t in u.needs if t not in produced_in[k]))
        outputs = list(dict.fromkeys(t for u in run for t in u.makes if t in later[k]))
        if kind == "cpu":
            subgraphs.append(Subgraph(name=name, kind=kind, graph=_cpu_body(g, run, inputs, outputs, name, pulled)))
            continue
        body, references[name] = _npu_bodies(g, run, inputs, outputs, name)
        lowered_ops[name] = [_lowered_op(u) for u in run]
        sg = Subgraph(name=name, kind=kind, graph=body)
        if sub is not None:
            sg.options = {**options.sub_configs[sub].options, "sub_config": sub}
        if hasattr(sg, "reference"):  # containers that carry the reference body next to the program
            sg.reference = references[name]
        subgraphs.append(sg)
    opsets = [o for o in qmodel.opset_import if o.domain != INT_DOMAIN] + [helper.make_opsetid(INT_DOMAIN, 1)]
    # debug only: the compiler stage prints the counts reconciled with the quantization placement
    log.debug("lowering: %d subgraphs (%d NPU, %d CPU); %d of %d ops on the NPU", len(subgraphs), count["npu"],
             count["cpu"], sum(v == "npu" for v in placement.values()), len(placement))
    return LoweredModel(subgraphs=subgraphs, references=references, fallbacks=fallbacks,
                        inputs=[_copy_vi(v) for v in g.graph_inputs], outputs=[_copy_vi(v) for v in g.graph_outputs],
                        opset_imports=opsets, placement=placement, ops=lowered_ops)


def _lowered_op(u: Unit) -> LoweredOp:
    assert u.ctx is not None
    compute = [n for n in u.nodes if not u.ctx.g.is_q(n)]
    return LoweredOp([n.name for n in compute], [n.op_type for n in compute], [n.op_type for n in u.ctx.nodes])


def _copy_vi(v: onnx.ValueInfoProto) -> onnx.ValueInfoProto:
    out = onnx.ValueInfoProto()
    out.CopyFrom(v)
    return out


def fallback_report(lowered: LoweredModel) -> list[tuple[str, str, str]]:
    """(op type, count and node names, reason) rows: ops on the CPU grouped by reason."""
    groups: dict[tuple[str, str], list[Fallback]] = {}
    for f in lowered.fallbacks:
        groups.setdefault((f.op_type, f.reason), []).append(f)
    rows = []
    for (op, reason), items in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        names = ", ".join(f.node for f in items[:3]) + (f", ... ({len(items)})" if len(items) > 3 else "")
        rows.append((op, names, reason))
    return rows


def placement_counts(lowered: LoweredModel, qmodel: onnx.ModelProto) -> dict[str, Counter[str]]:
    """op type -> Counter(npu=..., cpu=...) over the QDQ model's compute ops."""
    op_of = {n.name: n.op_type for n in QdqGraph(qmodel).graph.node}
    counts: dict[str, Counter[str]] = {}
    for node, kind in lowered.placement.items():
        counts.setdefault(op_of.get(node, "?"), Counter())[kind] += 1
    return counts
