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
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import onnx

from pulsar.errors import PulsarError
from pulsar.quant.precision import DEFAULT_DTYPE, HIGHEST_DTYPE, NodePrecision
from pulsar.quant.transformer import transformer_presets
from pulsar.ui import show, table

if TYPE_CHECKING:
    from collections.abc import Sequence

    from pulsar.config.generated import LayerConfig

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


# layer_configs fields that tune a layer without choosing its precision (pulsar.quant.layer_tuning)
TUNING_FIELDS = ("calibration_method", "calibration_percentile", "calibration_std_n", "calibration_kl_top_n",
                 "calibration_weighted_alpha", "weight_calibration_method", "bias_bits", "lut_items_in_bits")
_PRECISION_FIELDS = ("data_type", "output_data_type", "weight_data_type", "weight_granularity", "weight_group_size",
                     "activation_symmetric")


def tuning_only_entry(lc: LayerConfig) -> bool:
    """An entry that sets tuning fields and no precision: the precision resolution skips it."""
    return all(getattr(lc, f) is None for f in _PRECISION_FIELDS) and any(
        getattr(lc, f) is not None for f in TUNING_FIELDS)


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


def _selection(lc: LayerConfig, index: int, model: onnx.ModelProto) -> tuple[set[str], set[str], set[str], bool]:
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


def resolve_layer_precision(layer_configs: Sequence[LayerConfig], model: onnx.ModelProto, *, highest_mix_precision: bool = False,
                            transformer_opt_level: int = 0) -> dict[str, NodePrecision]:
    """node name -> precision for every node (the default, or U16 with highest_mix_precision)."""
    default = NodePrecision(HIGHEST_DTYPE, weight_data_type="S16") if highest_mix_precision else NodePrecision()
    chosen: dict[str, tuple[int, NodePrecision, int]] = {
        name: (0, prec, -1) for name, prec in transformer_presets(model, transformer_opt_level, default).items()}
    overridden: dict[tuple[int, int], list[str]] = defaultdict(list)  # (winner, loser) -> layers
    weights_only: list[tuple[int, Any]] = []
    for i, lc in enumerate(layer_configs):
        if tuning_only_entry(lc):
            continue  # pulsar.quant.layer_tuning resolves it
        if weights_only_entry(lc):
            weights_only.append((i, lc))
            continue
        named, ops, ranged, whole = _selection(lc, i, model)
        prec = NodePrecision(lc.data_type or DEFAULT_DTYPE, lc.output_data_type, lc.weight_data_type, explicit=True,
                             weight_granularity=lc.weight_granularity, activation_symmetric=lc.activation_symmetric,
                             weight_group_size=lc.weight_group_size)
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
    out = {n.name: chosen.get(n.name, (0, default, -1))[1] for n in model.graph.node}
    _apply_weights_only(weights_only, model, out, {n: r for n, (r, _p, k) in chosen.items() if k >= 0})
    return out


def weights_only_entry(lc: LayerConfig) -> bool:
    """An entry that sets the weights and leaves ``data_type`` out: the layers keep the activation
    precision chosen for them otherwise (U8, a preset's, another entry's)."""
    return lc.data_type is None and lc.output_data_type is None and lc.activation_symmetric is None and (
        lc.weight_data_type is not None or lc.weight_granularity is not None)


def _apply_weights_only(entries: list[tuple[int, LayerConfig]], model: onnx.ModelProto, out: dict[str, NodePrecision],
                        ranks: dict[str, int]) -> None:
    """Weight settings of weights-only entries, by the same priority as the others (a layer name beats
    an op type ...); an entry with a data_type that sets the weights too wins at a higher rank."""
    chosen: dict[str, tuple[int, tuple[str | None, str | None], int]] = {}
    for i, lc in entries:
        named, ops, ranged, whole = _selection(lc, i, model)
        value = (lc.weight_data_type, lc.weight_granularity)
        for n in model.graph.node:
            rank = 4 if n.name in named else 3 if n.op_type in ops else (1 if whole else 2) if n.name in ranged else -1
            if rank < 0:
                continue
            old = chosen.get(n.name)
            if old is not None and old[0] == rank and old[1] != value:
                raise PulsarError(
                    f"quant.layer_configs[{i}]: layer '{n.name}' ({n.op_type}) is also selected by "
                    f"quant.layer_configs[{old[2]}] with different weights, both by {_KIND[rank]}; give each "
                    "layer one weight precision (remove it from one of the entries)")
            if old is None or rank >= old[0]:
                chosen[n.name] = (rank, value, i)
    for name, (rank, (dtype, granularity), _i) in chosen.items():
        prec = out[name]
        if (prec.weight_data_type is not None or prec.weight_granularity is not None) and ranks.get(name, 0) > rank:
            continue  # a more specific entry with a data_type chose this layer's weights
        out[name] = replace(prec, weight_data_type=dtype or prec.weight_data_type,
                            weight_granularity=granularity or prec.weight_granularity)


def _kind_of(lc: LayerConfig) -> str:
    if lc.layer_name is not None or lc.layer_names is not None:
        return "layer name"
    if lc.op_type is not None or lc.op_types is not None:
        return "op type"
    return "subgraph range"


def show_layer_config_table(layer_configs: Sequence[LayerConfig], quiet: bool) -> None:
    if not layer_configs:
        return
    rows = []
    for lc in layer_configs:
        sel = ", ".join(_names(lc.layer_name) + _names(lc.layer_names) + _names(lc.op_type) + _names(lc.op_types))
        if lc.start_tensor_names is not None:
            sel = f"{_names(lc.start_tensor_names)} -> {_names(lc.end_tensor_names)}"
        extra = [f"out {lc.output_data_type}"] if lc.output_data_type else []
        extra += [f"weights {lc.weight_data_type}"] if lc.weight_data_type else []
        extra += ["weights per tensor"] if lc.weight_granularity == "per_tensor" else []
        extra += [f"weight groups of {lc.weight_group_size}"] if lc.weight_group_size else []
        if lc.activation_symmetric is not None:
            extra += ["symmetric" if lc.activation_symmetric else "affine"]
        extra += [f"{f} {getattr(lc, f)}" for f in TUNING_FIELDS if getattr(lc, f) is not None]
        base = ("tuning only" if tuning_only_entry(lc) else "weights only" if weights_only_entry(lc)
                else lc.data_type or DEFAULT_DTYPE)
        rows.append((sel, base + (f" ({', '.join(extra)})" if extra else "")))
    show(table("Layer Config Table", ["Op Type / Layer name / Subgraph", "Precision"], rows), quiet=quiet)
