"""``quant.layer_configs``: per-layer precision, resolved to one data type per node.

Priority when several entries match a node: a named layer beats an op type, which beats a
subgraph range; within one kind the later entry wins (as in a config file read top to bottom).
"""

from __future__ import annotations

from typing import Any

import onnx

from pulsar.ui import show, table

DEFAULT_DTYPE = "U8"


def _names(value: Any) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def resolve_layer_dtypes(layer_configs: Any, model: onnx.ModelProto) -> dict[str, str]:
    """node name -> data_type for every node some entry selects (others use the default)."""
    by_rank: dict[str, tuple[int, str]] = {}
    for lc in layer_configs:
        named = set(_names(lc.layer_name) + _names(lc.layer_names))
        ops = set(_names(lc.op_type) + _names(lc.op_types))
        for n in model.graph.node:
            rank = 2 if n.name in named else (1 if n.op_type in ops else -1)
            if rank >= 0 and rank >= by_rank.get(n.name, (-1, ""))[0]:
                by_rank[n.name] = (rank, lc.data_type)
    return {name: dtype for name, (_, dtype) in by_rank.items()}


def show_layer_config_table(layer_configs: Any, quiet: bool) -> None:
    if not layer_configs:
        return
    rows = []
    for lc in layer_configs:
        sel = ", ".join(_names(lc.layer_name) + _names(lc.layer_names) + _names(lc.op_type) + _names(lc.op_types))
        rows.append((sel, lc.data_type))
    show(table("Layer Config Table", ["Op Type / Layer name", "Precision"], rows), quiet=quiet)
