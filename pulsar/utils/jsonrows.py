"""JSON with one line per entry of its large tables: quant_config.json holds a few hundred tensors
and nodes, each a small object; ``json.dumps(indent=...)`` puts every number of every per-channel
scale list on a line of its own and runs in pure Python (the C encoder does not indent), 2x slower."""

from __future__ import annotations

import json
from typing import Any


def dumps_rows(doc: dict[str, Any]) -> str:
    """``doc`` as JSON: one top-level key per line; a value that is a table (a non-empty dict of dicts)
    one entry per line, each entry compact."""
    parts = []
    for key, value in doc.items():
        if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            rows = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in value.items())
            parts.append(f" {json.dumps(key)}: {{\n{rows}\n }}")
        else:
            parts.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(parts) + "\n}\n"
