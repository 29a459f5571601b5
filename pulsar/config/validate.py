"""Schema validation with messages a user can act on.

All problems are reported at once, each as ``<json path>: <bad value> <what was expected>`` with a
"did you mean" for misspelt keys and enum values.
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
                f"{' or '.join(_TYPE_NAMES.get(t, t) for t in expected)}"]
    if kw == "required":
        missing = [r for r in err.validator_value if r not in (err.instance or {})]
        return [f"{path}: missing required field '{m}'" for m in missing]
    if kw == "pattern":
        return [f"{path}: {_short(err.instance)} is not valid: expected {schema.get('description', err.message)}"]
    return [f"{path}: {err.message}"]


def validate(config: dict[str, Any], source: str = "config") -> None:
    """Raise :class:`ConfigError` listing every schema violation in ``config``."""
    validator = Draft202012Validator(load_schema(), format_checker=Draft202012Validator.FORMAT_CHECKER)
    problems: list[str] = []
    for err in sorted(validator.iter_errors(config), key=lambda e: (list(map(str, e.absolute_path)), e.validator)):
        for line in _format(err):
            if line not in problems:
                problems.append(line)
    if problems:
        raise ConfigError(problems, source)
