"""Read a config written in protobuf text format (``.prototxt``), which pulsar2 also accepts.

There is no ``.proto`` for the build config, so protobuf's own tokenizer splits the text (strings,
numbers, identifiers, ``#`` comments) and this small parser builds the mapping. What a message
cannot say by itself comes from the JSON schema: a key whose schema type is array is always a list
(given once, repeated, or as ``[a, b]``), any other key given twice is a duplicate (reported like
JSON's), and ``t`` / ``f`` / ``inf`` / ``nan`` are booleans or numbers only where the schema wants one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, NoReturn

from google.protobuf import text_format

from pulsar.config.sanity import MAX_DEPTH, MAX_INT_DIGITS, MAX_VALUES, Duplicate, HugeInt
from pulsar.config.schema import load_schema, resolve
from pulsar.errors import PulsarError

_INT = re.compile(r"[+-]?[0-9]+")
_HEX = re.compile(r"[+-]?0[xX][0-9a-fA-F]+")
_BOOLS = {"true": True, "True": True, "false": False, "False": False}
_SCHEMA_BOOLS = {"t": True, "f": False}  # protobuf's short forms, only where the schema wants a boolean
_NUMBER_WORDS = ("inf", "infinity", "nan")
_CLOSE = {"{": "}", "<": ">"}


def _types(node: dict[str, Any]) -> set[str]:
    t = node.get("type")
    return set(t) if isinstance(t, list) else ({t} if isinstance(t, str) else set())


def _child(node: dict[str, Any], key: str) -> dict[str, Any]:
    """The schema of ``key`` inside an object node ({} when unknown or free-form)."""
    prop = resolve(node).get("properties", {}).get(key) if node else None
    return resolve(prop) if isinstance(prop, dict) else {}


def _element(node: dict[str, Any]) -> dict[str, Any]:
    """The schema of one value of a field: its items for an array field."""
    if "array" in _types(node) and isinstance(node.get("items"), dict):
        return resolve(node["items"])
    return node


@dataclass
class _Given:
    """Every occurrence of one key in a message: (line, values, written as a [list])."""

    key: str
    occurrences: list[tuple[int, list[Any], bool]] = field(default_factory=list)


class _Parser:
    def __init__(self, text: str, where: str):
        self.tok = text_format.Tokenizer(text.split("\n"))
        self.where = where
        self.values = 0

    # -- positions and errors ----------------------------------------------------------------------
    def line(self) -> int:
        return int(self.tok.ParseError("").GetLine())

    def fail(self, message: str) -> NoReturn:
        err = self.tok.ParseError("")
        raise PulsarError(f"{self.where}: invalid prototxt at line {err.GetLine()} column {err.GetColumn()}: "
                          f"{message}")

    def shown(self) -> str:
        return repr(self.tok.token) if self.tok.token else "the end of the file"

    # -- grammar -----------------------------------------------------------------------------------
    def message(self, node: dict[str, Any], closing: str | None, depth: int) -> dict[Any, Any]:
        if depth > MAX_DEPTH:
            self.fail(f"nested more than {MAX_DEPTH} levels deep; a config is at most a few levels")
        given: dict[str, _Given] = {}
        while not (closing and self.tok.TryConsume(closing)):
            if self.tok.AtEnd():
                if closing is None:
                    break
                self.fail(f"missing '{closing}' before the end of the file")
            line = self.line()
            key = self.tok.token
            if not self.tok.TryConsumeIdentifier():
                self.fail(f"expected a field name, got {self.shown()}")
            sub = _child(node, key)
            if self.tok.TryConsume(":"):
                listed = self.tok.LookingAt("[")
                values = self.list(sub, depth) if listed else [self.value(sub, key, depth)]
            elif self.tok.token in _CLOSE:
                listed, values = False, [self.block(_element(sub), depth)]
            else:
                self.fail(f"expected ':' or '{{' after '{key}', got {self.shown()}")
            given.setdefault(key, _Given(key)).occurrences.append((line, values, listed))
            if not self.tok.TryConsume(","):
                self.tok.TryConsume(";")
        return _assemble(node, given)

    def block(self, node: dict[str, Any], depth: int) -> dict[Any, Any]:
        opening = self.tok.token
        self.tok.NextToken()
        return self.message(node, _CLOSE[opening], depth + 1)

    def list(self, node: dict[str, Any], depth: int) -> list[Any]:
        self.tok.Consume("[")
        out: list[Any] = []
        if self.tok.TryConsume("]"):
            return out
        while True:
            out.append(self.value(node, "", depth))
            if self.tok.TryConsume("]"):
                return out
            if not self.tok.TryConsume(","):
                self.fail(f"expected ',' or ']' in a list, got {self.shown()}")

    def value(self, node: dict[str, Any], key: str, depth: int) -> Any:
        self.values += 1
        if self.values > MAX_VALUES:
            self.fail(f"more than {MAX_VALUES:,} values; put tensor data in a file (const_processors[].data_path)")
        node = _element(node)
        token = self.tok.token
        if token in _CLOSE:
            return self.block(node, depth)
        if token[:1] in ("'", '"'):
            return self.string()
        if token[:1].isdigit() or token[:1] in "+-.":
            return self.number(token)
        if self.tok.TryConsumeIdentifier():
            return _word(token, _types(node))
        after = f" after '{key}:'" if key else ""
        self.fail(f"expected a value{after}, got {self.shown()}")

    def string(self) -> str:
        parts = []
        while self.tok.token[:1] in ("'", '"'):
            token = self.tok.token
            if len(token) < 2 or token[-1] != token[0]:
                self.fail("a string without its closing quote")
            try:
                parts.append(self.tok.ConsumeString())
            except text_format.ParseError as e:
                self.fail(f"cannot read the string {token}: {str(e).rsplit(': ', 1)[-1]}")
        return "".join(parts)

    def number(self, token: str) -> int | float | HugeInt:
        value: int | float | HugeInt
        if _INT.fullmatch(token) or _HEX.fullmatch(token):
            digits = len(token.lstrip("+-"))
            value = HugeInt(digits) if digits > MAX_INT_DIGITS else int(token, 16 if _HEX.fullmatch(token) else 10)
        else:
            try:
                value = text_format.ParseFloat(token)
            except ValueError:
                self.fail(f"{token!r} is not a number")
        self.tok.NextToken()
        return value


def _word(word: str, types: set[str]) -> Any:
    """A bare identifier: a boolean, a number word where the schema wants a number, else a string
    (enum values such as ONNX or MinMax)."""
    if word in _BOOLS:
        return _BOOLS[word]
    if "boolean" in types and word in _SCHEMA_BOOLS:
        return _SCHEMA_BOOLS[word]
    if types & {"number", "integer"} and word.lower() in _NUMBER_WORDS:
        return float(word.lower().replace("infinity", "inf"))
    return word


def _assemble(node: dict[str, Any], given: dict[str, _Given]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for key, g in given.items():
        sub = _child(node, key)
        if "array" in _types(sub) or (not sub and (len(g.occurrences) > 1 or g.occurrences[0][2])):
            out[key] = [v for _line, values, _listed in g.occurrences for v in values]
            continue
        for i, (line, values, listed) in enumerate(g.occurrences):
            out[Duplicate(key, f"line {line}") if i else key] = values if listed else values[0]
    return out


def parse_prototxt(text: str, where: str) -> dict[Any, Any]:
    """A build config in protobuf text format, as a mapping (not yet validated)."""
    try:
        return _Parser(text, where).message(load_schema(), None, 0)
    except RecursionError:
        raise PulsarError(f"{where}: nested too deeply to read; a config is at most a few levels deep") from None
