"""What a compiled model's metadata and subgraph options may hold: checked when written and when loaded.

The writer refuses to write what the loader would refuse, and the loader turns anything else (an
edited file, a file from another tool) into one line naming the entry, instead of a ``KeyError`` deep
inside a run. Subgraph options are the compiler options of the build config schema (the single
source of truth for their types and ranges) plus ``sub_config``; metadata keys that pulsar writes
have the types below, other keys (caller metadata) may hold any JSON value.

Metadata values are stored readably: a string as itself (``VNPU-M``), anything else (lists, dicts,
numbers, booleans, null) as JSON. A string that would itself parse as JSON (``"123"``, ``"true"``)
is stored JSON-quoted so it reads back as a string; older files stored every value as JSON, which
the same rule reads back unchanged.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from typing import Any

import numpy as np
from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError

from pulsar.errors import did_you_mean

BUILD_SCHEMA_FILE = "build_config.schema.json"  # in pulsar/schemas, as pulsar.config.schema.SCHEMA_FILE
SUB_CONFIG_KEY = "sub_config"  # index of the compiler.sub_configs range a subgraph was lowered from


# --------------------------------------------------------------------------- metadata values


def encode_value(value: object) -> str:
    """A metadata value as stored: strings as they are unless they would read back as JSON."""
    if isinstance(value, str):
        try:
            json.loads(value)
        except ValueError:
            return value
    return json.dumps(value, sort_keys=True)


def decode_value(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return text


# --------------------------------------------------------------------------- schemas

_STR = {"type": "string"}
_COUNT = {"type": "integer", "minimum": 0}
_DIM = {"anyOf": [_COUNT, _STR, {"type": "null"}]}
_TENSORS = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["name", "dtype", "shape"],
        "properties": {"name": _STR, "dtype": {"type": ["string", "null"]}, "shape": {"type": "array", "items": _DIM}},
    },
}

# Keys pulsar writes (pulsar/compiler/stage.py, pulsar/compiler/package.py) and their types.
METADATA_SCHEMA: dict[str, dict[str, Any]] = {
    "target_hardware": _STR,
    "npu_mode": _STR,
    "config_hash": _STR,
    "calibration_method": _STR,
    "source_model": _STR,
    "built_by": _STR,
    "inputs": _TENSORS,
    "outputs": _TENSORS,
    "processors": {"type": "array", "items": _STR},
    "estimate": {
        "type": "object",
        "properties": {"target": _STR, "npu_mode": _STR, "cycles": _COUNT, "macs": _COUNT,
                       "time_ms": {"type": "number", "minimum": 0},
                       # layers split by compiler.enable_tile_mode / enable_slice_mode (pulsar/compiler/tiling.py)
                       "tiling": {"type": "array", "items": {
                           "type": "object", "required": ["subgraph", "layer", "mode", "axis", "tiles"],
                           "properties": {"subgraph": _STR, "layer": _STR, "mode": {"enum": ["tile", "slice"]},
                                          "axis": _COUNT, "tiles": {"type": "array", "minItems": 2, "items": {
                                              "type": "array", "items": _COUNT, "minItems": 2, "maxItems": 2}}}}},
                       # compiler.enable_data_soft_compression: weight bytes raw / as stored in DDR
                       "soft_compression": {
                           "type": "object", "required": ["subgraphs", "raw_bytes", "stored_bytes", "ratio", "layers"],
                           "properties": {"subgraphs": {"type": "array", "items": _STR}, "raw_bytes": _COUNT,
                                          "stored_bytes": _COUNT, "ratio": {"type": "number", "minimum": 0},
                                          "layers": {"type": "array", "items": {
                                              "type": "object",
                                              "required": ["subgraph", "layer", "raw_bytes", "stored_bytes",
                                                           "encoding"],
                                              "properties": {"subgraph": _STR, "layer": _STR, "raw_bytes": _COUNT,
                                                             "stored_bytes": _COUNT, "encoding": _STR}}}}}},
    },
    "cpu_fallbacks": {
        "type": "array",
        "items": {"type": "object", "required": ["node", "op_type", "reason"],
                  "properties": {"node": _STR, "op_type": _STR, "reason": _STR}},
    },
    "variants": {"type": "array", "minItems": 1,
                 "items": {"type": "object", "required": ["group", "batch"],
                           "properties": {"group": _COUNT, "batch": {"type": "integer", "minimum": 1}}}},
    "batch_sizes": {"type": "array", "items": {"type": "integer", "minimum": 1}},
    "op_plugins": {"type": "array", "items": {"type": "object", "required": ["domain", "op_type", "file"],
                                              "properties": {"domain": _STR, "op_type": _STR, "file": _STR}}},
    "batch_mode": {"enum": ["static", "dynamic"]},
    "batch_axes": {"type": "object", "additionalProperties": _COUNT},
    "shape_groups": {"type": "array", "items": {"type": "object", "required": ["inputs", "outputs"],
                                                "properties": {"inputs": _TENSORS, "outputs": _TENSORS}}},
    "input_extra_shapes": {"type": "object", "additionalProperties": {"type": "array",
                                                                      "items": {"type": "array", "items": _COUNT}}},
}


def _resolve(node: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    """``node`` with a local ``$ref`` followed and the referenced node's properties merged in (as
    :func:`pulsar.config.schema.resolve` reads the same file)."""
    if "$ref" not in node:
        return node
    target: Any = root
    for part in node["$ref"][2:].split("/"):
        target = target[part]
    base = _resolve(target, root)
    merged = {**base, **{k: v for k, v in node.items() if k != "$ref"}}
    merged["properties"] = {**base.get("properties", {}), **node.get("properties", {})}
    return merged


@lru_cache(maxsize=1)
def option_schemas() -> dict[str, dict[str, Any]]:
    """Option key -> JSON schema of its value: the build config's compiler options (read from the
    schema file the config stage derives everything from), and sub_config."""
    text = resources.files("pulsar").joinpath("schemas").joinpath(BUILD_SCHEMA_FILE).read_text(encoding="utf-8")
    root = json.loads(text)
    props = _resolve(root["$defs"]["CompilerOptions"], root).get("properties", {})
    out = {k: {key: v for key, v in _resolve(s, root).items() if key not in ("default", "description")}
           for k, s in props.items()}
    out[SUB_CONFIG_KEY] = _COUNT
    return out


# --------------------------------------------------------------------------- checks

_TYPE_WORDS = {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "true or false",
               "array": "a list", "object": "a mapping", "null": "null"}


def _short(value: object) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _where(prefix: str, err: ValidationError) -> str:
    out = prefix
    for p in err.absolute_path:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


def check_value(prefix: str, schema: dict[str, Any], value: object) -> str | None:
    """None, or one line ``<prefix><path>: <value> <what was expected>`` for the first violation."""
    errors = sorted(Draft202012Validator(schema).iter_errors(value), key=lambda e: list(e.absolute_path))
    if not errors:
        return None
    err = errors[0]
    where = _where(prefix, err)
    if err.validator == "type":
        types: list[str] = err.validator_value if isinstance(err.validator_value, list) else [err.validator_value]
        expected = " or ".join(_TYPE_WORDS.get(t, t) for t in types)
        return f"{where}: {_short(err.instance)} is not {expected}"
    if err.validator == "anyOf":
        return f"{where}: {_short(err.instance)} is not a dimension (an integer >= 0, a name or null)"
    if err.validator == "required":
        missing = [k for k in err.validator_value if isinstance(err.instance, dict) and k not in err.instance]
        return f"{where}: missing key {missing[0]!r}" if missing else f"{where}: {err.message}"
    if err.validator in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        word = "at least" if "inimum" in str(err.validator) else "at most"
        return f"{where}: {_short(err.instance)} is out of range (must be {word} {err.validator_value})"
    if err.validator == "enum":
        return f"{where}: {_short(err.instance)} is not one of {err.validator_value}"
    message = err.message if len(err.message) <= 120 else err.message[:117] + "..."
    return f"{where}: {message}"


def option_problem(options: object) -> str | None:
    """None, or one line on the first problem of a subgraph's options (decoded from its JSON)."""
    if not isinstance(options, dict):
        return f"options {_short(options)} is not a mapping of compiler options"
    schemas = option_schemas()
    for key, value in options.items():
        if key not in schemas:
            return (f"unknown option {key!r}{did_you_mean(key, schemas)} (this pulsar knows the compiler options "
                    "of the build config and sub_config)")
        if value is None:  # an option the build left unset
            continue
        problem = check_value(f"option {key}", schemas[key], value)
        if problem:
            return problem
    return None


def metadata_problem(meta: dict[str, object]) -> str | None:
    """None, or one line on the first metadata entry (key without ``pulsar.``) of the wrong type."""
    for key, schema in METADATA_SCHEMA.items():
        if key not in meta:
            continue
        problem = check_value(f"pulsar.{key}", schema, meta[key])
        if problem:
            return problem
    for key in ("inputs", "outputs"):
        entries = meta.get(key)
        if not isinstance(entries, list):  # absent (the schema check above allows nothing else)
            continue
        for i, entry in enumerate(entries):
            dtype = entry.get("dtype")
            if dtype is None:
                continue
            try:
                np.dtype(dtype)
            except TypeError:
                return f"pulsar.{key}[{i}].dtype: {_short(dtype)} is not a numpy dtype"
    return None
