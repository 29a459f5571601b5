"""Read a config file: JSON (lenient, as users write it), YAML, TOML or prototxt.

JSON is read strictly first (``#`` / ``//`` comments and trailing commas removed in place, which is
all the configs printed in pulsar2's guide need); what strict JSON still refuses (unquoted keys,
single quotes, hex numbers ...) is read by the ``json5`` package, for files small enough that its
slower parser answers at once. The parsers never fail without saying where: a key given twice is
kept as a :class:`~pulsar.config.sanity.Duplicate` and an over-long integer as a
:class:`~pulsar.config.sanity.HugeInt`, so that :func:`pulsar.config.sanity.check_raw` reports them
with their JSON path; nesting too deep for the parser and files too large are one-line errors.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Hashable, Iterable
from pathlib import Path
from typing import Any

import json5
import yaml

from pulsar.config.sanity import MAX_FILE_BYTES, MAX_INT_DIGITS, Duplicate, HugeInt
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


# A JSON string (double or single quotes, with escapes), then a # / // comment to the end of the line
# or a /* */ comment; then, on the text without comments, a comma with only whitespace before } or ].
_STRING = r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\''
_COMMENTS = re.compile(_STRING + r"|(?:#|//)[^\n]*|/\*[\s\S]*?\*/")
_TRAILING_COMMAS = re.compile(_STRING + r"|,(?=\s*[}\]])")
_NOT_NEWLINE = re.compile(r"[^\n]")

# json5 reads about 100 KB a second: larger files must be JSON with comments and trailing commas.
MAX_JSON5_BYTES = 256 * 1024


def _blank_comment(m: re.Match[str]) -> str:
    token = m.group(0)
    return token if token[0] in "\"'" else _NOT_NEWLINE.sub(" ", token)  # lines and columns stay put


def _drop_trailing_comma(m: re.Match[str]) -> str:
    """A comma before } or ], unless it is all its {} / [] holds (``{,}`` stays an error, as in JSON5)."""
    if m.group(0) != ",":
        return m.group(0)
    text, i = m.string, m.start() - 1
    while i >= 0 and text[i] in " \t\r\n":
        i -= 1
    return "," if i < 0 or text[i] in "{[," else " "


def strip_json_comments(text: str) -> str:
    """Blank ``#``, ``//`` and ``/* */`` comments and trailing commas outside strings, keeping line and
    column numbers intact."""
    return _TRAILING_COMMAS.sub(_drop_trailing_comma, _COMMENTS.sub(_blank_comment, text))


def _json_pairs(pairs: Iterable[tuple[str, Any]]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for k, v in pairs:
        out[Duplicate(k) if k in out else k] = v
    return out


def _json_int(text: str, base: int = 10) -> int | HugeInt:
    digits = text.lstrip("+-")
    if digits[:2].lower() == "0x":  # JSON5 hex
        digits, base = digits[2:], 16
    return HugeInt(len(digits)) if len(digits) > MAX_INT_DIGITS else int(text, base)


def parse_json_text(text: str, where: str, invalid: str = "invalid JSON") -> Any:
    """JSON with duplicate keys and over-long integers marked (see module docstring); NaN / Infinity
    literals are read as floats and rejected later by path."""
    try:
        return json.loads(text, object_pairs_hook=_json_pairs, parse_int=_json_int)
    except json.JSONDecodeError as e:
        raise PulsarError(f"{where}: {invalid} at line {e.lineno} column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise PulsarError(f"{where}: nested too deeply to read; a config is at most a few levels deep") from None


# json5's messages: '<string>:LINE Unexpected "X" at column COL'
_JSON5_ERROR = re.compile(r'<string>:(\d+) (.*) at column (\d+)$', re.DOTALL)
_JSON5_UNEXPECTED = re.compile(r'Unexpected "(.*)"$', re.DOTALL)


def _json5_message(error: str) -> str:
    m = _JSON5_ERROR.match(error)
    if not m:
        return error.splitlines()[0] if error else "not JSON"
    line, what, column = m.groups()
    if u := _JSON5_UNEXPECTED.match(what):
        what = "unexpected end of line" if u.group(1) == "\n" else f"unexpected {u.group(1)!r}"
    return f"at line {line} column {column}: {what.lower()}"


def parse_lenient_json(text: str, where: str) -> Any:
    """A ``.json`` config as users write it: strict JSON after :func:`strip_json_comments`, else JSON5."""
    cleaned = strip_json_comments(text)
    deep = PulsarError(f"{where}: nested too deeply to read; a config is at most a few levels deep")
    try:
        return json.loads(cleaned, object_pairs_hook=_json_pairs, parse_int=_json_int)
    except RecursionError:
        raise deep from None
    except json.JSONDecodeError as e:
        if len(text) > MAX_JSON5_BYTES:
            raise PulsarError(f"{where}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    try:
        return json5.loads(cleaned, object_pairs_hook=_json_pairs, parse_int=_json_int)
    except RecursionError:
        raise deep from None
    except ValueError as e:
        raise PulsarError(f"{where}: invalid JSON {_json5_message(str(e))}") from None


@register_parser(".json")
def _parse_json(text: str, path: Path) -> Any:
    return parse_lenient_json(text, str(path))


@register_parser(".prototxt", ".pbtxt")
def _parse_prototxt(text: str, path: Path) -> Any:
    from pulsar.config.prototxt import parse_prototxt  # protobuf loads only for prototxt configs

    return parse_prototxt(text, str(path))


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that keeps a duplicate key (with its line) instead of letting the last one win,
    and marks integers too long to convert."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:  # type: ignore[override]
        n_explicit = sum(1 for k, _v in node.value if k.tag != "tag:yaml.org,2002:merge")
        self.flatten_mapping(node)  # merged entries (<<) first; explicit keys may override them
        first_explicit = len(node.value) - n_explicit
        mapping: dict[Any, Any] = {}
        explicit: set[Any] = set()
        for i, (key_node, value_node) in enumerate(node.value):
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                raise yaml.constructor.ConstructorError(None, None, "a mapping key must be a plain value",
                                                        key_node.start_mark)
            value = self.construct_object(value_node, deep=deep)
            if i >= first_explicit:
                if key in explicit:
                    key = Duplicate(str(key), f"line {key_node.start_mark.line + 1}")
                else:
                    explicit.add(key)
            mapping[key] = value
        return mapping

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int | HugeInt:  # type: ignore[override]
        text = str(node.value).replace("_", "").lstrip("+-")
        if len(text) > MAX_INT_DIGITS:
            return HugeInt(len(text))
        return super().construct_yaml_int(node)  # type: ignore[no-any-return]


_YamlLoader.add_constructor("tag:yaml.org,2002:int", _YamlLoader.construct_yaml_int)


@register_parser(".yaml", ".yml")
def _parse_yaml(text: str, path: Path) -> Any:
    try:
        return yaml.load(text, Loader=_YamlLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise PulsarError(f"{path}: invalid YAML{where}: {problem}") from None
    except RecursionError:
        raise PulsarError(f"{path}: nested too deeply to read; a config is at most a few levels deep") from None


@register_parser(".toml")
def _parse_toml(text: str, path: Path) -> Any:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise PulsarError(f"{path}: invalid TOML: {e}") from None
    except RecursionError:
        raise PulsarError(f"{path}: nested too deeply to read; a config is at most a few levels deep") from None
    except ValueError as e:  # an integer beyond Python's digit limit
        what = f"an integer with more than {MAX_INT_DIGITS} digits" if "digits" in str(e) else str(e)
        raise PulsarError(f"{path}: invalid TOML: {what}") from None


def read_mapping_file(path: str | Path, what: str = "config file") -> Any:
    """Parse a JSON / YAML / TOML file (a config, a target profile) with the same limits as a config:
    size, depth, expansion, duplicate keys, huge or non-finite numbers. Syntax errors read
    ``<what> <path>: not valid YAML ...``."""
    from pulsar.config.sanity import check_raw

    try:
        data = parse_file(path, what)
    except PulsarError as e:
        raise PulsarError(f"{what} {str(e).replace(': invalid ', ': not valid ', 1)}; fix the syntax") from None
    problems = check_raw(data)
    if problems:
        raise PulsarError(f"{what} {path}: {problems[0]}" + (f" (and {len(problems) - 1} more)"
                                                           if len(problems) > 1 else ""))
    return data


def parse_file(path: str | Path, what: str = "config file") -> Any:
    """Parse a JSON / YAML / TOML / prototxt file by its extension (size-capped, UTF-8)."""
    p = Path(path)
    parser = PARSERS.get(p.suffix.lower())
    if parser is None:
        raise PulsarError(
            f"{p}: unsupported {what} extension '{p.suffix}'; use one of {', '.join(sorted(PARSERS))}"
        )
    if not p.exists():
        raise PulsarError(f"{what} {p} does not exist")
    if not p.is_file():
        raise PulsarError(f"{what} {p} is not a regular file")
    try:
        size = p.stat().st_size
        if size > MAX_FILE_BYTES:
            raise PulsarError(f"{p}: {size:,} bytes; a {what} is at most {MAX_FILE_BYTES:,} bytes (put tensor "
                              "data in a file and point const_processors[].data_path at it)")
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PulsarError(f"{p}: not a UTF-8 text file ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise PulsarError(f"{what} {p} cannot be read: {e.strerror}") from None
    return parser(text, p)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Parse a config file into a dict (not yet validated)."""
    p = Path(path)
    data = parse_file(p)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PulsarError(f"{p}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data
