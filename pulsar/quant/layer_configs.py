"""``quant.layer_configs`` (and ``highest_mix_precision``): one precision per node.

Priority when several entries select a node: a named layer beats an op type, which beats a
subgraph range, which beats a whole-model range (``DEFAULT`` -> ``DEFAULT``). Two entries of the
same kind that give one layer different precisions are an error (which one was meant?), and a
range whose end tensors do not follow its start tensors selects nothing, also an error. Overlaps
across kinds are intended (a precision for the model, exceptions by op type and by name) and are
logged with the rule that decided.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import onnx

from pulsar.errors import PulsarError
from pulsar.quant.precision import HIGHEST_DTYPE, NodePrecision
from pulsar.quant.transformer import transformer_presets
from pulsar.ui import show, table

log = logging.getLogger(__name__)

def _names(value: Any) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def subgraph_nodes(model: onnx.ModelProto, starts: list[str], ends: list[str]) -> set[str]:
    """Nodes on a path from a start tensor to an end tensor (``DEFAULT`` on either side: open)."""
    g = model.graph
    if "DEFAULT" in starts and "DEFAULT" in ends:
        return {n.name for n in g.node}
    readers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    maker: dict[str, onnx.NodeProto] = {}
    for n in g.node:
        for i in n.input:
            readers[i].append(n)
        for o in n.output:
            maker[o] = n
    forward: set[str] = {n.name for n in g.node}
    if "DEFAULT" not in starts:
        forward, stack = set(), list(starts)
        while stack:
            for n in readers.get(stack.pop(), []):
                if n.name not in forward:
                    forward.add(n.name)
                    stack.extend(n.output)
    backward: set[str] = {n.name for n in g.node}
    if "DEFAULT" not in ends:
        backward, stack = set(), list(ends)
        while stack:
            n = maker.get(stack.pop())
            if n is not None and n.name not in backward:
                backward.add(n.name)
                stack.extend(n.input)
    return forward & backward


_KIND = {4: "layer name", 3: "op type", 2: "subgraph range", 1: "whole-model range"}


def _check_range(model: onnx.ModelProto, index: int, starts: list[str], ends: list[str]) -> None:
    """Every end tensor must be reached from a start tensor, or the range selects nothing there."""
    if "DEFAULT" in starts or "DEFAULT" in ends:
        return
    after = {t for t in starts}
    for n in model.graph.node:  # topological order (the frontend keeps it sorted)
        if any(i in after for i in n.input):
            after.update(o for o in n.output if o)
    lost = [e for e in ends if e not in after or e in starts]
    if lost:
        raise PulsarError(f"quant.layer_configs[{index}].end_tensor_names: {', '.join(map(repr, lost))} does not "
                          f"follow the start tensors {starts}; the range selects no layer there (swap start and "
                          "end, or pick tensors downstream of the start)")


def _selection(lc: Any, index: int, model: onnx.ModelProto) -> tuple[set[str], set[str], set[str], bool]:
    named = set(_names(lc.layer_name) + _names(lc.layer_names))
    ops = set(_names(lc.op_type) + _names(lc.op_types))
    ranged: set[str] = set()
    whole = False
    if lc.start_tensor_names is not None:
        starts, ends = _names(lc.start_tensor_names), _names(lc.end_tensor_names)
        _check_range(model, index, starts, ends)
        ranged = subgraph_nodes(model, starts, ends)
        whole = "DEFAULT" in starts and "DEFAULT" in ends
    return named, ops, ranged, whole


def resolve_layer_precision(layer_configs: Any, model: onnx.ModelProto, *, highest_mix_precision: bool = False,
                            transformer_opt_level: int = 0) -> dict[str, NodePrecision]:
    """node name -> precision for every node (the default, or U16 with highest_mix_precision)."""
    default = NodePrecision(HIGHEST_DTYPE, weight_data_type="S16") if highest_mix_precision else NodePrecision()
    chosen: dict[str, tuple[int, NodePrecision, int]] = {
        name: (0, prec, -1) for name, prec in transformer_presets(model, transformer_opt_level, default).items()}
    overridden: dict[tuple[int, int], list[str]] = defaultdict(list)  # (winner, loser) -> layers
    for i, lc in enumerate(layer_configs):
        named, ops, ranged, whole = _selection(lc, i, model)
        prec = NodePrecision(lc.data_type, lc.output_data_type, lc.weight_data_type, explicit=True)
        for n in model.graph.node:
            rank = 4 if n.name in named else 3 if n.op_type in ops else (1 if whole else 2) if n.name in ranged else -1
            if rank < 0:
                continue
            old_rank, old_prec, old_i = chosen.get(n.name, (-1, default, -1))
            if old_i >= 0 and old_rank == rank and old_prec != prec:
                raise PulsarError(
                    f"quant.layer_configs[{i}]: layer '{n.name}' ({n.op_type}) is also selected by "
                    f"quant.layer_configs[{old_i}] with a different precision, both by {_KIND[rank]}; give each "
                    "layer one precision (remove it from one of the entries)")
            if rank >= old_rank:
                if old_i >= 0 and rank > old_rank and old_prec != prec:
                    overridden[(i, old_i)].append(n.name)
                chosen[n.name] = (rank, prec, i)
            elif old_prec != prec:
                overridden[(old_i, i)].append(n.name)
    for (win, lose), layers in overridden.items():
        log.info("layer_configs[%d] (%s) overrides layer_configs[%d] for %d layer(s) (%s): a layer name beats an "
                 "op type, which beats a subgraph range, which beats the whole model", win,
                 _kind_of(layer_configs[win]), lose, len(layers), ", ".join(layers[:5]) + (" ..." if len(layers) > 5
                                                                                      else ""))
    return {n.name: chosen.get(n.name, (0, default, -1))[1] for n in model.graph.node}


def _kind_of(lc: Any) -> str:
    if lc.layer_name is not None or lc.layer_names is not None:
        return "layer name"
    if lc.op_type is not None or lc.op_types is not None:
        return "op type"
    return "subgraph range"


def show_layer_config_table(layer_configs: Any, quiet: bool) -> None:
    if not layer_configs:
        return
    rows = []
    for lc in layer_configs:
        sel = ", ".join(_names(lc.layer_name) + _names(lc.layer_names) + _names(lc.op_type) + _names(lc.op_types))
        if lc.start_tensor_names is not None:
            sel = f"{_names(lc.start_tensor_names)} -> {_names(lc.end_tensor_names)}"
        extra = [f"out {lc.output_data_type}"] if lc.output_data_type else []
        extra += [f"weights {lc.weight_data_type}"] if lc.weight_data_type else []
        rows.append((sel, lc.data_type + (f" ({', '.join(extra)})" if extra else "")))
    show(table("Layer Config Table", ["Op Type / Layer name / Subgraph", "Precision"], rows), quiet=quiet)
