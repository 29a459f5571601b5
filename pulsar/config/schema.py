"""The build-config JSON Schema: the single source of truth.

Defaults, CLI flags, `pulsar config` output and the typed config objects are all derived from
``build_config.schema.json``; nothing here lists a field by hand.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

SCHEMA_FILE = "build_config.schema.json"


@lru_cache(maxsize=1)
def load_schema() -> dict[str, Any]:
    """The schema shipped inside the package (``schemas/`` at the repo root links to it)."""
    text = resources.files("pulsar").joinpath("schemas").joinpath(SCHEMA_FILE).read_text(encoding="utf-8")
    return json.loads(text)


def resolve(node: dict[str, Any], root: dict[str, Any] | None = None) -> dict[str, Any]:
    """Follow ``$ref`` (local only) and merge the referenced node's properties into ``node``'s."""
    root = root or load_schema()
    if "$ref" not in node:
        return node
    ref = node["$ref"]
    if not ref.startswith("#/"):
        raise ValueError(f"only local $ref supported, got {ref}")
    target: Any = root
    for part in ref[2:].split("/"):
        target = target[part]
    base = copy.deepcopy(resolve(target, root))
    merged = {**base, **{k: v for k, v in node.items() if k != "$ref"}}
    merged["properties"] = {**base.get("properties", {}), **node.get("properties", {})}
    return merged


def def_name(node: dict[str, Any]) -> str | None:
    ref = node.get("$ref", "")
    return ref.rsplit("/", 1)[-1] if ref else None


def is_object(node: dict[str, Any]) -> bool:
    return node.get("type") == "object" and "properties" in node


def item_schema(node: dict[str, Any]) -> dict[str, Any] | None:
    """The resolved item schema of an array of objects, else None."""
    if node.get("type") != "array" or "items" not in node:
        return None
    item = resolve(node["items"])
    return item if is_object(item) else None


def fill_defaults(data: dict[str, Any] | None, node: dict[str, Any] | None = None) -> dict[str, Any]:
    """Return a copy of ``data`` with every schema default filled in, recursively.

    Objects marked ``x-inherit`` (compiler sub_configs) are not filled: their unset options inherit
    from the enclosing section instead of taking the global default.
    """
    node = resolve(node or load_schema())
    out = copy.deepcopy(data) if data is not None else {}
    if not isinstance(out, dict):
        return out
    for key, prop in node.get("properties", {}).items():
        prop_r = resolve(prop)
        if key not in out:
            if "default" in prop_r:
                out[key] = copy.deepcopy(prop_r["default"])
            else:
                continue
        if is_object(prop_r) and isinstance(out[key], dict):
            out[key] = fill_defaults(out[key], prop_r)
        else:
            item = item_schema(prop_r)
            if item is not None and isinstance(out[key], list) and not item.get("x-inherit"):
                out[key] = [fill_defaults(x, item) if isinstance(x, dict) else x for x in out[key]]
    return out


def default_config() -> dict[str, Any]:
    return fill_defaults({})


@dataclass(frozen=True)
class Leaf:
    """A config field that is also a command-line flag ``--<path>``."""

    path: tuple[str, ...]
    node: dict[str, Any]

    @property
    def flag(self) -> str:
        return "--" + ".".join(self.path)

    @property
    def kind(self) -> str:
        """bool | integer | number | string | list | json (an array of objects, given as JSON)."""
        t = self.node.get("type")
        if t == "boolean":
            return "bool"
        if t == "array":
            return "json" if item_schema(self.node) is not None else "list"
        if t in ("integer", "number"):
            return t
        return "string"

    @property
    def item_type(self) -> str:
        return resolve(self.node.get("items", {})).get("type", "string")

    @property
    def choices(self) -> list[str]:
        if "enum" in self.node:
            return list(self.node["enum"])
        for alt in self.node.get("anyOf", []):
            if "enum" in alt:
                return list(alt["enum"])
        return []


def leaves(node: dict[str, Any] | None = None, prefix: tuple[str, ...] = ()) -> Iterator[Leaf]:
    """Every scalar and list field, depth first, in schema order."""
    node = resolve(node or load_schema())
    for key, prop in node.get("properties", {}).items():
        prop_r = resolve(prop)
        if is_object(prop_r):
            yield from leaves(prop_r, (*prefix, key))
        else:
            yield Leaf((*prefix, key), prop_r)


def section_of(leaf: Leaf) -> str:
    return leaf.path[0] if len(leaf.path) > 1 else "model"
