"""Read a config file: JSON (with ``#`` / ``//`` comments, as users write them), YAML or TOML."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from pulsar.errors import PulsarError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

Parser = Callable[[str, Path], Any]
PARSERS: dict[str, Parser] = {}


def register_parser(*suffixes: str) -> Callable[[Parser], Parser]:
    def deco(fn: Parser) -> Parser:
        for s in suffixes:
            PARSERS[s] = fn
        return fn

    return deco


def strip_json_comments(text: str) -> str:
    """Remove ``#`` and ``//`` line comments outside strings, keeping line numbers intact."""
    out: list[str] = []
    in_str = escape = False
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if in_str:
            out.append(c)
            if escape:
                escape = False
            elif c == "\\":
                escape = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
            out.append(c)
        elif c == "#" or text.startswith("//", i):
            while i < n and text[i] != "\n":
                i += 1
            continue
        else:
            out.append(c)
        i += 1
    return "".join(out)


@register_parser(".json")
def _parse_json(text: str, path: Path) -> Any:
    try:
        return json.loads(strip_json_comments(text))
    except json.JSONDecodeError as e:
        raise PulsarError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from e


@register_parser(".yaml", ".yml")
def _parse_yaml(text: str, path: Path) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise PulsarError(f"{path}: invalid YAML{where}: {problem}") from e


@register_parser(".toml")
def _parse_toml(text: str, path: Path) -> Any:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise PulsarError(f"{path}: invalid TOML: {e}") from e


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Parse a config file into a dict (not yet validated)."""
    p = Path(path)
    parser = PARSERS.get(p.suffix.lower())
    if parser is None:
        raise PulsarError(
            f"{p}: unsupported config file extension '{p.suffix}'; use one of {', '.join(sorted(PARSERS))}"
        )
    if not p.is_file():
        raise PulsarError(f"config file {p} does not exist")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PulsarError(f"{p}: not a UTF-8 text file ({e.reason})") from e
    data = parser(text, p)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PulsarError(f"{p}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data
