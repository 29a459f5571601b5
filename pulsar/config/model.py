"""Typed, read-only config objects generated from the schema at import time.

The pipeline reads ``cfg.quant.calibration_method`` instead of ``cfg["quant"]["calibration_method"]``;
a misspelt attribute fails loudly. The classes are built from the schema (one per object node,
named after its ``$defs`` entry), so adding a field to the schema adds it here with no code change.
"""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any

from pulsar.config.schema import def_name, is_object, item_schema, load_schema, resolve

_PY_TYPES: dict[str, Any] = {"boolean": bool, "integer": int, "number": float, "string": str, "array": list,
                             "object": dict}


def _key(node: dict[str, Any]) -> str:
    return str(sorted(resolve(node).get("properties", {})))


@cache
def _class_for(name: str, key: str) -> type:
    node = _NODES[key]
    fields = []
    for prop, sub in resolve(node).get("properties", {}).items():
        t = resolve(sub).get("type", "string")
        py = _PY_TYPES.get(t, Any) if isinstance(t, str) else Any
        fields.append((prop, py | None, dataclasses.field(default=None)))
    return dataclasses.make_dataclass(name, fields, frozen=True)


_NODES: dict[str, dict[str, Any]] = {}


def _typed(value: Any, node: dict[str, Any], name: str) -> Any:
    node_r = resolve(node)
    if is_object(node_r) and isinstance(value, dict):
        key = _key(node_r)
        _NODES[key] = node_r
        cls = _class_for(name, key)
        kwargs = {}
        for prop, sub in node_r["properties"].items():
            if prop in value:
                kwargs[prop] = _typed(value[prop], sub, def_name(sub) or _camel(prop))
        return cls(**kwargs)
    item = item_schema(node_r)
    if item is not None and isinstance(value, list):
        iname = def_name(node_r.get("items", {})) or _camel(name)
        return tuple(_typed(v, item, iname) for v in value)
    if isinstance(value, list):
        return tuple(value)
    return value


def _camel(name: str) -> str:
    return "".join(p.capitalize() for p in name.split("_")) + "Config"


def to_typed(config: dict[str, Any]) -> Any:
    """Build the typed ``BuildConfig`` object from a validated, default-filled config dict."""
    return _typed(config, load_schema(), "BuildConfig")


def to_dict(obj: Any) -> Any:
    """Inverse of :func:`to_typed` (unset optional fields are dropped)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if getattr(obj, f.name) is not None}
    if isinstance(obj, tuple):
        return [to_dict(v) for v in obj]
    return obj
