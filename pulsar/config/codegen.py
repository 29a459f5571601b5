"""Write ``pulsar/config/generated.py``: the typed config classes, generated from the schema.

One frozen dataclass per object node of ``build_config.schema.json``, named after its ``$defs`` entry
(else the CamelCase of its property + ``Config``; the root is ``BuildConfig``), with one field per
property, typed from the schema: ``str``, ``int``, ``float``, ``bool``, ``Literal[...]`` for enums,
the nested class for an object, ``tuple[X, ...]`` for an array, a union for a list of types,
``dict[str, Any]`` for a free-form object. Every field defaults to None; its type includes None
unless the loader always sets it (:func:`pulsar.config.schema.fill_defaults` fills a non-null schema
default, or validation requires it), so ``cfg.quant.calibration_method`` is a ``Literal[...]`` and
``LayerConfig.layer_name`` a ``str | None``. Nothing is filled into ``x-inherit`` array items
(compiler ``sub_configs``: unset options inherit), so their optional fields keep None. A node that
extends a ``$defs`` object with ``$ref`` plus its own properties becomes a subclass of that
object's class (``CompilerConfig(CompilerOptions)``) when their field types agree.

    python -m pulsar.config.codegen           # rewrite generated.py after changing the schema
    python -m pulsar.config.codegen --check   # exit 1 if generated.py does not match the schema
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pulsar.config.schema import SCHEMA_FILE, def_name, is_object, load_schema, resolve

GENERATED = Path(__file__).with_name("generated.py")
REGENERATE = "python -m pulsar.config.codegen"
ROOT_CLASS = "BuildConfig"
LINE_LENGTH = 110  # [tool.ruff] line-length
_SCALARS = {"string": "str", "integer": "int", "number": "float", "boolean": "bool", "null": "None"}


@dataclass
class _Field:
    name: str
    type: str  # the annotation, `| None` included where the field may be unset
    always: bool  # the loader always sets it (a schema default it fills, or required): default FILLED
    doc: str


@dataclass
class _Class:
    name: str
    base: str | None
    doc: str
    fields: list[_Field] = field(default_factory=list)


def camel(prop: str) -> str:
    """``auto_mixed_precision`` -> ``AutoMixedPrecisionConfig``: the class of an inline object."""
    return "".join(p[:1].upper() + p[1:] for p in prop.split("_")) + "Config"


class _Generator:
    """Walks the schema from the root, making one :class:`_Class` per object node on first use."""

    def __init__(self, schema: dict[str, Any]):
        self.schema = schema
        self.classes: dict[str, _Class] = {}  # in definition order: bases and nested classes first
        self.keys: dict[str, str] = {}  # class name -> what it was made from (tells apart two nodes of one name)
        self.imports: set[str] = set()

    def _resolve(self, node: dict[str, Any]) -> dict[str, Any]:
        return resolve(node, self.schema)

    def _target(self, node: dict[str, Any]) -> dict[str, Any]:
        """The ``$defs`` node a ``$ref`` names (unmerged)."""
        target: Any = self.schema
        for part in node["$ref"][2:].split("/"):
            target = target[part]
        return dict(target)

    def class_of(self, node: dict[str, Any], name: str, owner: str = "", filled: bool = True) -> str:
        """The class for an object node (generated on first use): named ``name`` unless a ``$defs`` ref,
        ``owner`` + ``name`` when another node has that name. ``filled``: the loader fills the schema
        defaults into the node's dicts (not into ``x-inherit`` array items, nor anything inside them)."""
        if "$ref" in node and not node.get("properties"):  # a plain reference (description / default aside)
            ref_name = def_name(node)
            assert ref_name is not None
            return self.class_of(self._target(node), ref_name, owner, filled)
        key = json.dumps([node, filled], sort_keys=True)
        if self.keys.get(name, key) != key:  # another node already has this name
            name = owner + name
            if self.keys.get(name, key) != key:
                raise ValueError(f"two different schema objects would both be class {name}")
        if name in self.keys:
            return name
        self.keys[name] = key
        node_r = self._resolve(node)
        base, own = None, node_r["properties"]
        if "$ref" in node:  # extends a $defs object: a subclass of its class, if the fields agree
            target, base_name = self._target(node), def_name(node)
            target_r = self._resolve(target)
            assert base_name is not None
            if (is_object(target_r) and not set(node["properties"]) & set(target_r["properties"])
                    and self.keys.get(base_name, json.dumps([target, filled], sort_keys=True))
                    == json.dumps([target, filled], sort_keys=True)):
                base = self.class_of(target, base_name, filled=filled)
                own = node["properties"]
        required = set(node_r.get("required", ()))
        cls = _Class(name, base, str(node_r.get("description", "")))
        for prop, sub in own.items():
            sub_r = self._resolve(sub)
            always = prop in required or (filled and sub_r.get("default") is not None)
            t = self.type_of(sub, prop, name, filled)
            cls.fields.append(_Field(prop, t if always else _optional(t), always, str(sub_r.get("description", ""))))
        self.classes[name] = cls
        return name

    def type_of(self, node: dict[str, Any], prop: str, owner: str, filled: bool) -> str:
        """The annotation (without ``| None``) of a property or array item."""
        node_r = self._resolve(node)
        if is_object(node_r):
            return self.class_of(node, camel(prop), owner, filled)
        t = node_r.get("type")
        if isinstance(t, list):
            return _union(self.type_of({**node_r, "type": one}, prop, owner, filled) for one in t)
        if t is None:
            alts = node_r.get("anyOf") or node_r.get("oneOf")
            if alts and all("type" in a or "$ref" in a for a in alts):
                return _union(self.type_of(a, prop, owner, filled) for a in alts)
            literal = self._literal(node_r, (str, int, bool))
            if literal:
                return literal
            self.imports.add("Any")
            return "Any"
        if t == "array":
            items = node_r.get("items")
            if not isinstance(items, dict) or not items:
                self.imports.add("Any")
                return "tuple[Any, ...]"
            filled = filled and not self._resolve(items).get("x-inherit")
            return f"tuple[{self.type_of(items, prop, owner, filled)}, ...]"
        if t == "object":
            extra = node_r.get("additionalProperties")
            if isinstance(extra, dict) and extra:
                return f"dict[str, {self.type_of(extra, prop, owner, False)}]"
            self.imports.add("Any")
            return "dict[str, Any]"
        if t in ("string", "integer"):
            literal = self._literal(node_r, str if t == "string" else int)
            if literal:
                return literal
        return _SCALARS.get(t, "Any")

    def _literal(self, node: dict[str, Any], kinds: type | tuple[type, ...]) -> str | None:
        """``Literal[...]`` when the node allows only listed values (``enum`` / ``const``, or ``anyOf`` /
        ``oneOf`` alternatives that are all such), else None."""
        values = _values(node)
        if values is None:
            alts = node.get("anyOf") or node.get("oneOf")
            if not alts:
                return None
            values = []
            for alt in alts:
                some = _values(alt)
                if some is None:
                    return None
                values += [v for v in some if v not in values]
        if not values or not all(isinstance(v, kinds) for v in values):
            return None
        self.imports.add("Literal")
        return "Literal[" + ", ".join(json.dumps(v) if isinstance(v, str) else repr(v) for v in values) + "]"


def _values(node: dict[str, Any]) -> list[Any] | None:
    if "enum" in node:
        return list(node["enum"])
    if "const" in node:
        return [node["const"]]
    return None


def _union(types: Iterable[str]) -> str:
    """``a | b`` from annotations that may be unions themselves, without repeats."""
    out: list[str] = []
    for t in types:
        out += [one for one in _members(t) if one not in out]
    return " | ".join(out)


def _members(t: str) -> list[str]:
    """The top-level members of a union annotation: ``tuple[int | str, ...] | None`` -> 2."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(t):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "|" and depth == 0:
            parts.append(t[start:i].strip())
            start = i + 1
    return [*parts, t[start:].strip()]


def _optional(t: str) -> str:
    return t if "Any" in _members(t) or "None" in _members(t) else f"{t} | None"


def _docstring(text: str, indent: str) -> list[str]:
    text = " ".join(text.split()).replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
    if not text:
        return []
    if text.startswith('"'):
        text = '\\"' + text[1:]
    if text.endswith('"'):
        text = text[:-1] + '\\"'
    one = f'{indent}"""{text}"""'
    if len(one) <= LINE_LENGTH:
        return [one]
    lines = textwrap.wrap(text, LINE_LENGTH - len(indent) - 3, break_long_words=False, break_on_hyphens=False)
    return [f'{indent}"""{lines[0]}', *(f"{indent}{line}" for line in lines[1:]), f'{indent}"""']


def _field_lines(f: _Field) -> list[str]:
    default = "FILLED" if f.always else "None"
    one = f"    {f.name}: {f.type} = {default}"
    if len(one) <= LINE_LENGTH or not f.type.startswith("Literal["):
        return [one]
    literal, _, rest = f.type.partition("]")
    words = [w.strip() for w in literal[len("Literal["):].split(", ")]
    if literal.count('"') != 2 * len(words):  # a value with "]" or ", " in it: leave the line long
        return [one]
    lines, line = [f"    {f.name}: Literal["], "       "
    for w in words:
        if len(line) + 1 + len(w) + 1 > LINE_LENGTH:
            lines.append(line)
            line = "       "
        line += f" {w},"
    return [*lines, line, f"    ]{rest} = {default}"]


def render(schema: dict[str, Any] | None = None) -> str:
    """The text of ``generated.py`` for ``schema`` (default: the packaged one)."""
    schema = schema or load_schema()
    gen = _Generator(schema)
    gen.class_of(schema, ROOT_CLASS)
    for name, node in schema.get("$defs", {}).items():  # objects not reached from the root (none today)
        if name not in gen.keys and is_object(resolve(node, schema)):
            gen.class_of({"$ref": f"#/$defs/{name}"}, name)
    typing_names = sorted(gen.imports | {"Any"})
    out = [
        f"# Generated by pulsar/config/codegen.py from pulsar/schemas/{SCHEMA_FILE}: do not edit.",
        f"# After changing the schema, regenerate with: {REGENERATE}",
        '"""Typed, read-only config classes: one per object of the build-config schema (see codegen.py)."""',
        "",
        "from __future__ import annotations",
        "",
        "from dataclasses import dataclass",
        f"from typing import {', '.join(typing_names)}",
        "",
        "#: The default of the fields the loader always sets (a schema default, or required), whose types",
        "#: therefore leave out None: only an object built by hand, not by to_typed, holds None there.",
        "FILLED: Any = None",
    ]
    for cls in gen.classes.values():
        out += ["", "", "@dataclass(frozen=True)", f"class {cls.name}{f'({cls.base})' if cls.base else ''}:"]
        body = _docstring(cls.doc, "    ")
        for f in cls.fields:
            if body:
                body.append("")
            body += _field_lines(f) + _docstring(f.doc, "    ")
        out += body or ["    pass"]
    return "\n".join(out) + "\n"


def stale() -> str | None:
    """A one-line message when generated.py does not match the schema, else None."""
    current = GENERATED.read_text(encoding="utf-8") if GENERATED.is_file() else ""
    if current == render():
        return None
    return f"{GENERATED.relative_to(GENERATED.parents[2])} does not match the schema: run `{REGENERATE}`"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=REGENERATE, description="Generate pulsar/config/generated.py from the schema.")
    parser.add_argument("--check", action="store_true", help="exit 1 if generated.py is out of date; write nothing")
    args = parser.parse_args(argv)
    if args.check:
        message = stale()
        if message:
            print(message, file=sys.stderr)
            return 1
        return 0
    text = render()
    if not GENERATED.is_file() or GENERATED.read_text(encoding="utf-8") != text:
        GENERATED.write_text(text, encoding="utf-8")
        print(f"wrote {GENERATED}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
