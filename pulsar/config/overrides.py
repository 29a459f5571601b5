"""Command-line overrides generated from the schema: every leaf is a flag ``--section.field``.

Values are parsed by the leaf's schema type (bool, integer, number, string, list, JSON for lists of
objects); ranges and enums are then checked by the schema validator, so the command line and the
config file get the same messages.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

from pulsar.config.schema import Leaf, leaves
from pulsar.errors import PulsarError, did_you_mean

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _parse_bool(text: str, flag: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise PulsarError(f"{flag}: '{text}' is not a boolean; use true/false/1/0 (or the bare flag for true)")


def _parse_scalar(kind: str, text: str, flag: str) -> Any:
    try:
        if kind == "integer":
            return int(text)
        if kind == "number":
            value = float(text)
            if not math.isfinite(value):
                raise PulsarError(f"{flag}: '{text}' is not a finite number; give a real value")
            return value
    except ValueError:
        raise PulsarError(f"{flag}: '{text}' is not {'an integer' if kind == 'integer' else 'a number'}") from None
    if kind == "boolean":
        return _parse_bool(text, flag)
    return text


def _parse_list(leaf: Leaf, values: list[str]) -> list[Any]:
    items: list[str] = []
    for v in values:
        # "1 2 4" as separate words, or "1,2,4" as one; strings (regexes) are never split on commas.
        items.extend(x for x in v.split(",") if x) if leaf.item_type in ("integer", "number") else items.append(v)
    return [_parse_scalar(leaf.item_type, x, leaf.flag) for x in items]


def _parse_json(leaf: Leaf, text: str) -> Any:
    from pulsar.config.loader import parse_json_text

    try:
        return parse_json_text(text, leaf.flag, invalid="not valid JSON")
    except PulsarError as e:
        raise PulsarError(f"{e}; pass a JSON list like '[{{...}}]'") from None


def leaf_map() -> dict[str, Leaf]:
    return {leaf.flag: leaf for leaf in leaves()}


def parse_overrides(args: Sequence[str], *, extra_flags: dict[str, str] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Parse ``--a.b value`` words into ``({"a.b": value}, {other_flag: value})``.

    ``extra_flags`` maps non-schema flags (``--config``, ``--debug``) to "value" or "bool".
    A list flag takes every following word up to the next ``--flag``.
    """
    known = leaf_map()
    extra_flags = extra_flags or {}
    overrides: dict[str, Any] = {}
    others: dict[str, Any] = {}
    i = 0
    while i < len(args):
        word = args[i]
        if not word.startswith("--"):
            raise PulsarError(f"unexpected argument '{word}'; every option is a --flag (see --help)")
        flag, eq, inline = word.partition("=")
        values: list[str] = [inline] if eq else []
        j = i + 1
        if not eq:
            while j < len(args) and not args[j].startswith("--"):
                values.append(args[j])
                j += 1
        i = j
        if flag in extra_flags:
            if extra_flags[flag] == "bool":
                others[flag] = _parse_bool(values[0], flag) if values else True
            elif len(values) != 1:
                raise PulsarError(f"{flag} takes one value")
            else:
                others[flag] = values[0]
            continue
        leaf = known.get(flag)
        if leaf is None:
            raise PulsarError(f"unknown option {flag}{did_you_mean(flag, [*known, *extra_flags])}; "
                              "`pulsar build --help` lists them all")
        kind = leaf.kind
        if kind == "list":
            value: Any = _parse_list(leaf, values)
        elif kind == "bool" and not values:
            value = True
        elif len(values) != 1:
            raise PulsarError(f"{flag} takes one value, got {len(values)}: {' '.join(values) or '(none)'}")
        elif kind == "json":
            value = _parse_json(leaf, values[0])
        else:
            value = _parse_scalar({"bool": "boolean"}.get(kind, kind), values[0], flag)
        overrides[".".join(leaf.path)] = value
    return overrides, others


def apply_overrides(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Return a copy of ``config`` with dotted-path overrides set (command line wins over the file)."""
    out = copy.deepcopy(config)
    known = {".".join(leaf.path) for leaf in leaves()}
    for dotted, value in overrides.items():
        if dotted not in known:
            raise PulsarError(f"unknown override '{dotted}'{did_you_mean(dotted, known)}")
        node = out
        *parents, last = dotted.split(".")
        for p in parents:
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
        node[last] = value
    return out


def describe_leaf(leaf: Leaf, default_of: Callable[[Leaf], Any]) -> tuple[str, str, str]:
    """(type, default, help) columns for ``--help``."""
    kind = leaf.kind
    type_name = {"list": f"list of {leaf.item_type}", "json": "JSON list", "bool": "bool"}.get(kind, kind)
    if leaf.choices:
        type_name = "{" + "|".join(leaf.choices) + "}"
    default = default_of(leaf)
    return type_name, json.dumps(default) if not isinstance(default, str) else (default or "''"), \
        leaf.node.get("description", "")
