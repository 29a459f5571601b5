"""Schema validation with messages a user can act on.

All problems are reported at once, each as ``<json path>: <bad value> <what was expected>`` with a
"did you mean" for misspelt keys and enum values. A value of the wrong type is reported as that and
first; the rules that combine fields (``oneOf``, ``not`` ...) are not reported for it or inside it,
since they only make sense on a well-typed section.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError

from pulsar.config.schema import load_schema, resolve
from pulsar.errors import PulsarError, did_you_mean


class ConfigError(PulsarError):
    """One or more invalid config fields; ``problems`` holds one line per field."""

    def __init__(self, problems: list[str], source: str = "config"):
        self.problems = problems
        head = f"{source}: {len(problems)} problem{'s' if len(problems) > 1 else ''}: "
        super().__init__(head + "; ".join(problems))


def json_path(parts: Iterable[Any]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _did_you_mean_ci(word: Any, candidates: list[str]) -> str:
    """Case-insensitive first (kl -> KL), then fuzzy."""
    for c in candidates:
        if isinstance(word, str) and c.lower() == word.lower():
            return f' (did you mean "{c}"?)'
    return did_you_mean(word, candidates)


_TYPE_NAMES = {"integer": "an integer", "number": "a number", "string": "a string", "boolean": "true or false",
               "array": "a list", "object": "a mapping"}


_PY_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "a list",
             dict: "a mapping", type(None): "empty"}


def _describe_alt(alt: dict[str, Any]) -> str:
    if "const" in alt:
        return json.dumps(alt["const"])
    lo, hi = alt.get("minimum", alt.get("exclusiveMinimum")), alt.get("maximum", alt.get("exclusiveMaximum"))
    if lo is not None and hi is not None:
        return f"a value in [{lo}, {hi}]"
    if lo is not None:
        return f">= {lo}"
    if hi is not None:
        return f"<= {hi}"
    return alt.get("description", json.dumps(alt))


_BOUNDS = {"maximum": "at most", "minimum": "at least", "exclusiveMaximum": "below", "exclusiveMinimum": "above"}


def _mapping_hint(schema: dict[str, Any], value: Any) -> str:
    """For a plain value where a mapping belongs: its keys, and the mapping to write when one key
    takes the value (``[1, 3, 8, 8]`` -> ``{"shape": [1, 3, 8, 8]}``)."""
    if resolve(schema).get("type") != "object" or isinstance(value, dict):
        return ""
    required = list(resolve(schema).get("required", []))
    if not required:
        return ""
    keys = ", ".join(f"'{k}'" for k in required)
    hint = f" with key{'s' if len(required) > 1 else ''} {keys}"
    shown = json.dumps(value)
    if len(required) == 1 and len(shown) <= 60:
        hint += f" (write {{{json.dumps(required[0])}: {shown}}})"
    return hint


def _format(err: ValidationError) -> list[str]:
    path = json_path(err.absolute_path)
    schema = err.schema if isinstance(err.schema, dict) else {}
    kw = err.validator
    if kw in ("additionalProperties", "unevaluatedProperties"):
        known = list(resolve(schema).get("properties", {}))
        extra = [k for k in err.instance if k not in known] if isinstance(err.instance, dict) else []
        prefix = "" if path == "(top level)" else path + "."
        return [f"{prefix}{k}: unknown field{did_you_mean(k, known)}" for k in extra] or [f"{path}: {err.message}"]
    if "x-message" in schema and kw in ("oneOf", "not", "anyOf", "dependentRequired"):
        return [f"{path}: {schema['x-message']}"]
    if kw == "enum":
        return [f"{path}: {_short(err.instance)} is not one of {', '.join(map(str, err.validator_value))}"
                f"{_did_you_mean_ci(err.instance, list(map(str, err.validator_value)))}"]
    if kw == "anyOf":
        enums = [v for alt in err.validator_value for v in alt.get("enum", [])]
        desc = schema.get("description", "")
        if enums:
            return [f"{path}: {_short(err.instance)} is not one of {', '.join(enums)} "
                    f"and not a matching value ({desc}){_did_you_mean_ci(err.instance, enums)}"]
        return [f"{path}: {_short(err.instance)} is out of range: expected "
                f"{' or '.join(_describe_alt(a) for a in err.validator_value)}"]
    if kw == "type":
        expected = err.validator_value if isinstance(err.validator_value, list) else [err.validator_value]
        got = _PY_NAMES.get(type(err.instance), type(err.instance).__name__)
        return [f"{path}: {_short(err.instance)} is {got}, expected "
                f"{' or '.join(_TYPE_NAMES.get(str(t), str(t)) for t in expected)}{_mapping_hint(schema, err.instance)}"]
    if kw in _BOUNDS:
        return [f"{path}: {_short(err.instance)} is out of range; it must be {_BOUNDS[kw]} {err.validator_value:,}"]
    if kw == "required":
        missing = [r for r in err.validator_value if r not in (err.instance or {})]
        return [f"{path}: missing required field '{m}'" for m in missing]
    if kw == "pattern":
        return [f"{path}: {_short(err.instance)} is not valid: expected {schema.get('description', err.message)}"]
    return [f"{path}: {err.message}"]


def _under(path: tuple[Any, ...], mistyped: list[tuple[Any, ...]]) -> bool:
    """``path`` is a mistyped value or lies inside one."""
    return any(path[:len(m)] == m for m in mistyped)


def validate(config: dict[str, Any], source: str = "config") -> None:
    """Raise :class:`ConfigError` listing every schema violation in ``config``."""
    validator = Draft202012Validator(load_schema(), format_checker=Draft202012Validator.FORMAT_CHECKER)
    problems: list[str] = []
    errors = list(validator.iter_errors(config))
    mistyped = [tuple(e.absolute_path) for e in errors if e.validator == "type"]
    errors = [e for e in errors if e.validator == "type" or not _under(tuple(e.absolute_path), mistyped)]
    for err in sorted(errors, key=lambda e: (e.validator != "type", list(map(str, e.absolute_path)), e.validator)):
        for line in _format(err):
            if line not in problems:
                problems.append(line)
    if problems:
        raise ConfigError(problems, source)
