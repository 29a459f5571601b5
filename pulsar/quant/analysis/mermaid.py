"""The precision graph as a mermaid ``flowchart TD``: one node per op, coloured by cosine.

Colours (thresholds from :mod:`pulsar.quant.analysis.metrics`): green ``good`` cosine >= 0.999,
yellow ``ok`` >= 0.99, red ``bad`` below; grey ``na`` for ops without a row (non-float output).
The ``worst`` lowest-cosine layers get a thick dark-red border (class ``worst``) and a numbered
note in the "worst layers" subgraph, linked to them with a dotted arrow. Mermaid ids must be
``[A-Za-z0-9_]``, so ids are ``N<index>_<sanitized name>`` (unique by index; capitalised so a
leading ``o`` / ``x`` is never read as an arrow head); label text is entity-escaped.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence

import onnx

from pulsar.quant.analysis.metrics import COSINE_GOOD, COSINE_OK, grade
from pulsar.quant.analysis.perlayer import LayerPrecision, layer_name
from pulsar.utils.atomic import atomic_write_text

CLASS_DEFS = {
    "good": "fill:#c8e6c9,stroke:#2e7d32,color:#000",
    "ok": "fill:#fff59d,stroke:#f9a825,color:#000",
    "bad": "fill:#ffcdd2,stroke:#c62828,color:#000",
    "worst": "fill:#ffcdd2,stroke:#7f0000,stroke-width:4px,color:#000",
    "na": "fill:#eeeeee,stroke:#9e9e9e,color:#000",
    "io": "fill:#e3f2fd,stroke:#1565c0,color:#000",
    "note": "fill:#fff,stroke:#7f0000,stroke-dasharray:4 2,color:#7f0000",
}
# Escaped first: '#' starts mermaid entity codes.
_ESCAPES = [("#", "#35;"), ('"', "#quot;"), ("<", "#lt;"), (">", "#gt;"), ("[", "#91;"), ("]", "#93;"),
            ("(", "#40;"), (")", "#41;"), ("{", "#123;"), ("}", "#125;"), ("|", "#124;"), ("`", "#96;")]


def sanitize_id(prefix: str, index: int, name: str) -> str:
    return f"{prefix}{index}_{re.sub(r'[^A-Za-z0-9_]', '_', name)[:40]}"


def escape(text: str) -> str:
    for ch, code in _ESCAPES:
        text = text.replace(ch, code)
    return text.replace("\n", " ")


def _cos_text(cos: float) -> str:
    return f"cos {cos:.4f}" if math.isfinite(cos) else f"cos {cos}"


def worst_rows(rows: Sequence[LayerPrecision], n: int) -> list[LayerPrecision]:
    """The ``n`` lowest-cosine rows (NaN counts as worst)."""
    return sorted(rows, key=lambda r: (not math.isnan(r.cosine), r.cosine))[:max(n, 0)]


def mermaid_text(float_model: onnx.ModelProto, rows: Sequence[LayerPrecision], *, worst: int = 5) -> str:
    g = float_model.graph
    by_node = {r.node: r for r in rows}
    worst_list = worst_rows(rows, worst)
    worst_names = {r.node for r in worst_list}
    inits = {t.name for t in g.initializer}
    lines = ["flowchart TD",
             f"%% node colour = cosine vs float: green >= {COSINE_GOOD}, yellow >= {COSINE_OK}, red below;",
             "%% thick dark-red border = one of the worst layers (see the 'worst layers' notes)"]
    lines += [f"  classDef {k} {v}" for k, v in CLASS_DEFS.items()]
    classes: dict[str, list[str]] = {k: [] for k in CLASS_DEFS}
    source: dict[str, str] = {}
    for k, vi in enumerate(i for i in g.input if i.name not in inits):
        nid = sanitize_id("IN", k, vi.name)
        lines.append(f'  {nid}(["{escape(vi.name)}"])')
        classes["io"].append(nid)
        source[vi.name] = nid
    node_ids: dict[str, str] = {}
    edges: list[tuple[str, str]] = []
    for idx, n in enumerate(g.node):
        name = layer_name(n, idx)
        nid = sanitize_id("N", idx, name)
        node_ids[name] = nid
        row = by_node.get(name)
        label = f"{escape(name)}<br/>{escape(n.op_type)}"
        if row is not None:
            label += f"<br/>{_cos_text(row.cosine)}"
        lines.append(f'  {nid}["{label}"]')
        cls = "na" if row is None else ("worst" if name in worst_names else grade(row.cosine))
        classes[cls].append(nid)
        edges += [(source[i], nid) for i in n.input if i in source]
        for o in n.output:
            if o:
                source[o] = nid
    for k, vo in enumerate(g.output):
        nid = sanitize_id("OUT", k, vo.name)
        lines.append(f'  {nid}(["{escape(vo.name)}"])')
        classes["io"].append(nid)
        if vo.name in source:
            edges.append((source[vo.name], nid))
    seen: set[tuple[str, str]] = set()
    for e in edges:
        if e not in seen:
            seen.add(e)
            lines.append(f"  {e[0]} --> {e[1]}")
    if worst_list:
        lines.append(f"  subgraph WORST [worst {len(worst_list)} layers by cosine]")
        for k, r in enumerate(worst_list, 1):
            lines.append(f'    W{k}["#35;{k} {escape(r.node)}<br/>{escape(r.op_type)} {_cos_text(r.cosine)}"]')
            classes["note"].append(f"W{k}")
        lines.append("  end")
        lines += [f"  W{k} -.-> {node_ids[r.node]}" for k, r in enumerate(worst_list, 1) if r.node in node_ids]
    lines += [f"  class {','.join(ids)} {cls}" for cls, ids in classes.items() if ids]
    return "\n".join(lines) + "\n"


def write_mermaid(float_model: onnx.ModelProto, rows: Sequence[LayerPrecision], path: str | os.PathLike, *,
                  worst: int = 5) -> str:
    """Write the mermaid precision graph atomically to ``path``; return its text."""
    text = mermaid_text(float_model, rows, worst=worst)
    atomic_write_text(path, text)
    return text
