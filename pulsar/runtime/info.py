"""``pulsar info``: what a compiled model takes and returns, how it is split, what it was built for.

Everything comes from the file (checked by :func:`pulsar.core.container.load_compiled`): the
graph's inputs / outputs, the subgraph nodes and the ``pulsar.*`` metadata the build recorded. The
tables show user text (tensor names, paths) literally.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import cast

from rich.table import Table

from pulsar.core.container import FORMAT_NAME, CompiledModel, load_compiled, tensor_infos
from pulsar.core.variants import (
    BATCH_MODE_KEY,
    BATCH_SIZES_KEY,
    SHAPE_GROUPS_KEY,
    VARIANTS_KEY,
    is_multi_batch,
)
from pulsar.ui import table


def _shape(dims: Sequence[object]) -> str:
    return "x".join("?" if d is None else str(d) for d in dims) if dims else "scalar"


def _processor(name: str, notes: list[str]) -> str:
    """The build's processor line for tensor ``name`` (without the name), or '-'."""
    for line in notes:
        if line.startswith(f"{name}: "):
            return line[len(name) + 2:]
    return "-"


def _estimate(est: object) -> str:
    if not isinstance(est, dict) or not est:
        return "-"
    parts = []
    if "time_ms" in est:
        parts.append(f"{est['time_ms']:.4g} ms")
    if "cycles" in est:
        parts.append(f"{est['cycles']:,} cycles")
    if "macs" in est:
        parts.append(f"{est['macs']:,} MACs")
    where = " ".join(str(est[k]) for k in ("target", "npu_mode") if k in est)
    packed = est.get("soft_compression")
    weights = (f"; weights in DDR {packed['raw_bytes']:,} -> {packed['stored_bytes']:,} bytes (soft compression)"
               if isinstance(packed, dict) else "")
    return ", ".join(parts) + (f" on {where}" if where else "") + " (a model, not a measurement)" + weights


def summary_tables(compiled: CompiledModel, path: Path) -> list[Table]:
    """The tables ``pulsar info`` prints: the model, its inputs / outputs, subgraphs, CPU fallbacks."""
    meta = compiled.metadata
    processors = cast("Iterable[object]", meta.get("processors", []))  # checked when loaded: a list of str
    notes = [n for n in processors if isinstance(n, str)]

    def text(key: str) -> str:
        value = meta.get(key)
        return "-" if value is None else str(value)

    rows = [
        ("file", str(path)),
        ("format", f"{FORMAT_NAME} version {compiled.format_version}"),
        ("written by", f"pulsar {compiled.pulsar_version}"),
        ("checksum", f"{compiled.checksum} (verified)" if compiled.checksum else "none (written before checksums)"),
        ("target hardware", text("target_hardware")),
        ("npu_mode", text("npu_mode")),
        ("estimate", _estimate(meta.get("estimate"))),
        ("config hash", text("config_hash")),
        ("source model", text("source_model")),
        ("calibration method", text("calibration_method")),
    ]
    tables = [table("Compiled model", ["field", "value"], rows)]
    for title, values in (("Inputs", compiled.model.graph.input), ("Outputs", compiled.model.graph.output)):
        io_rows = [(t["name"], t["dtype"], _shape(cast("list[object]", t["shape"])),
                    _processor(str(t["name"]), notes))
                   for t in tensor_infos(values)]
        tables.append(table(title, ["name", "dtype", "shape", "processor"], io_rows))
    ranges = any("sub_config" in sg.options for sg in compiled.subgraphs)
    sg_rows = []
    for sg in compiled.subgraphs:
        ops = Counter(n.op_type for n in sg.graph.node)
        counts = ", ".join(f"{op} {k}" for op, k in sorted(ops.items(), key=lambda kv: (-kv[1], kv[0])))
        row = [sg.name, sg.kind.upper(), str(len(sg.graph.node)), counts or "-"]
        if ranges:
            sub = sg.options.get("sub_config")
            row.append("-" if sub is None else f"compiler.sub_configs[{sub}]")
        sg_rows.append(row)
    columns = ["name", "runs on", "ops", "op counts"] + (["range"] if ranges else [])
    tables.append(table("Subgraphs (in execution order)", columns, sg_rows))
    variant_table = _variants(compiled)
    if variant_table is not None:
        tables.append(variant_table)
    groups: dict[str, list[dict[str, str]]] = {}
    # checked when loaded: a list of {node, op_type, reason} strings
    for f in cast("list[dict[str, str]]", meta.get("cpu_fallbacks") or []):
        groups.setdefault(f["reason"], []).append(f)
    if groups:
        fallback_rows = []
        for reason, items in groups.items():
            names = ", ".join(f["node"] for f in items[:4]) + (f", ... ({len(items)})" if len(items) > 4 else "")
            fallback_rows.append((reason, ", ".join(dict.fromkeys(f["op_type"] for f in items)), names))
        tables.append(table("Ops kept on the CPU", ["reason", "ops", "nodes"], fallback_rows))
    return tables


def _variants(compiled: CompiledModel) -> Table | None:
    """One row per compiled (group, batch): input shapes, estimate, the subgraphs that have a body."""
    meta = compiled.metadata
    if VARIANTS_KEY not in meta:
        return None
    listed = cast("list[dict[str, object]]", meta[VARIANTS_KEY])
    groups = cast("list[dict[str, list[dict[str, object]]]]", meta.get(SHAPE_GROUPS_KEY) or [])
    multi = is_multi_batch(meta)
    rows = []
    for k, entry in enumerate(listed):
        group, batch = int(cast(int, entry["group"])), int(cast(int, entry["batch"]))
        shapes = []
        for t in (groups[group]["inputs"] if group < len(groups) else []):
            dims = list(cast("list[object]", t["shape"]))
            if multi and dims:
                dims[0] = batch
            shapes.append(f"{t['name']} {_shape(dims)}")
        est = cast("dict[str, float]", entry.get("estimate") or {})
        ms = f"{est['time_ms']:.4g} ({est['time_ms'] / batch:.4g} per sample)" if "time_ms" in est else "-"
        have = [sg.name for sg in compiled.subgraphs if sg.has(k)]
        bodies = "all" if len(have) == len(compiled.subgraphs) else ", ".join(have)
        rows.append((str(k), str(group), str(batch), ", ".join(shapes), ms, bodies))
    mode = meta.get(BATCH_MODE_KEY)
    title = f"Variants ({mode} multi-batch {meta.get(BATCH_SIZES_KEY)}; pulsar run --batch_size N runs N samples as " \
            "them, --group_index picks the group)" if mode else "Variants (pulsar run --group_index picks the group)"
    return table(title, ["variant", "group", "batch", "inputs", "estimate ms", "subgraphs"], rows)


def model_summary(path: str | Path) -> list[Table]:
    """Load (and verify) ``path`` and return its summary tables."""
    path = Path(path)
    return summary_tables(load_compiled(path), path)
