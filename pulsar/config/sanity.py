"""Limits and value checks on a parsed config, before anything is built from it.

A config file is user input like any other: it can be deeply nested, hold an integer with thousands
of digits, a YAML alias bomb that expands to billions of values, ``NaN`` in a numeric field, keys
given twice, or a path with a NUL byte. The parsers (``loader.py``) mark duplicate keys and huge
numbers instead of failing without a location; :func:`check_raw` then walks the data once, with a
budget on the values it visits (so an alias bomb is caught after a million visits, not expanded),
and reports every problem with its JSON path, like the schema validator does.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pulsar.config.artifacts import OUTPUT_DIR_ENTRIES, colliding_artifact

MAX_DEPTH = 32  # the schema is 5 levels deep; free-form values (const data) rarely need more than 6
MAX_VALUES = 1_000_000  # values visited, counting every use of a YAML alias
MAX_INT_DIGITS = 30  # int64 needs 19
MAX_STRING = 65_536  # characters in one string (names, paths, regexes)
MAX_FILE_BYTES = 32 * 1024 * 1024  # a config larger than this holds data: use const_processors[].data_path

# Fields whose float values are tensor data, where an infinity is a legitimate value (an attention
# mask constant); everywhere else a non-finite number is a mistake.
_TENSOR_DATA = re.compile(r"^const_processors\[\d+\]\.data(\[\d+\])*$")

# Fields holding file-system paths: no control characters (a NUL byte cannot reach the OS; a
# newline or escape sequence in a path is never intended and would garble every message).
PATH_FIELDS = ("input", "output_dir", "work_dir", "output_name", "target_hardware", "quant.input_sample_dir",
               "compiler.input_sample_dir", "quant.input_configs[*].calibration_dataset",
               "const_processors[*].data_path")

# Names that ``output_name`` may not take: the other artifacts of a build, and pulsar's own files.
RESERVED_OUTPUT_NAMES = set(OUTPUT_DIR_ENTRIES)

# A shape group's input tensor (float32) is at most this large: the simulator and the checks hold it.
MAX_SHAPE_BYTES = 4 << 30
MAX_DIM = 2**31 - 1  # a dim in input_shapes (ONNX stores int64; runtimes index with int32)


@dataclass(frozen=True)
class Duplicate:
    """A mapping key given more than once (the parsers keep it instead of letting the last one win)."""

    key: str
    where: str = ""  # "line 12" when the parser knows it

    def __hash__(self) -> int:
        return hash(("\0duplicate", self.key, self.where))


@dataclass(frozen=True)
class HugeInt:
    """An integer literal too long to be a config value (its digits are not converted)."""

    digits: int


class BudgetExceeded(Exception):
    pass


def _number_problems(value: int | float, where: Callable[[], str]) -> list[str]:
    if isinstance(value, float):
        if math.isfinite(value):
            return []
        path = where()
        if math.isinf(value) and _TENSOR_DATA.match(path):
            return []
        return [f"{path}: {value} is not a finite number; give a real value"]
    if value.bit_length() > 100:  # cheap first test; 30 digits need about 100 bits
        digits = len(str(abs(value)))
        if digits > MAX_INT_DIGITS:
            return [f"{where()}: an integer with {digits} digits; numbers in a config have at most {MAX_INT_DIGITS}"]
    return []


def json_path(parts: list[str | int]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


_TYPE_HINTS = {"date": "a date", "datetime": "a date and time", "time": "a time", "bytes": "binary data",
               "set": "a set", "tuple": "a list"}


@dataclass(frozen=True)
class _At:
    """A value's place: its parent's place and its key, turned into a path only when reported."""

    parent: _At | None
    key: str | int

    def parts(self) -> list[str | int]:
        out: list[str | int] = []
        node: _At | None = self
        while node is not None:
            out.append(node.key)
            node = node.parent
        return out[::-1]


def _path(at: _At | None, *more: str | int) -> str:
    return json_path([*(at.parts() if at else []), *more])


def _walk(data: Any) -> Iterator[tuple[_At | None, Any, int]]:
    """(place, value, depth) for every value, iteratively; raises BudgetExceeded past MAX_VALUES.
    Lists of plain numbers (tensor data) are yielded whole, as one value."""
    stack: list[tuple[_At | None, Any, int]] = [(None, data, 0)]
    visited = 0
    while stack:
        at, value, depth = stack.pop()
        visited += len(value) if isinstance(value, list) else 1
        if visited > MAX_VALUES:
            raise BudgetExceeded
        yield at, value, depth
        if depth >= MAX_DEPTH:
            continue
        if isinstance(value, dict):
            stack.extend((_At(at, k if isinstance(k, str) else repr(k)), v, depth + 1)
                         for k, v in reversed(list(value.items())))
        elif isinstance(value, list) and not _plain_numbers(value):
            stack.extend((_At(at, i), v, depth + 1) for i, v in reversed(list(enumerate(value))))


def _plain_numbers(values: list[Any]) -> bool:
    return all(type(v) is int or type(v) is float for v in values)


def expanded_size(data: Any) -> int:
    """How many values ``data`` holds once every shared (aliased) value is counted at each use;
    computed once per distinct object, so a billion-laughs document costs microseconds."""
    sizes: dict[int, int] = {}
    stack: list[tuple[Any, bool]] = [(data, False)]
    while stack:
        obj, children_done = stack.pop()
        if not isinstance(obj, (dict, list)) or (id(obj) in sizes and not children_done):
            continue
        kids = list(obj.values()) if isinstance(obj, dict) else obj
        if children_done:
            sizes[id(obj)] = 1 + sum(sizes.get(id(k), 1) for k in kids)
        else:
            sizes[id(obj)] = 0  # on the stack; a cycle (impossible from our parsers) counts as 0
            stack.append((obj, True))
            stack.extend((k, False) for k in kids if isinstance(k, (dict, list)) and id(k) not in sizes)
    return sizes.get(id(data), 1)


def check_raw(data: Any) -> list[str]:
    """Problems with the values themselves (before the schema looks at them), one line each."""
    problems: list[str] = []
    try:
        if expanded_size(data) > MAX_VALUES:
            raise BudgetExceeded
        for at, value, depth in _walk(data):
            if depth >= MAX_DEPTH and isinstance(value, (dict, list)) and value:
                problems.append(f"{_path(at)}: nested more than {MAX_DEPTH} levels deep; a config is at most a "
                                "few levels (put tensor data in a file: const_processors[].data_path)")
                break
            if isinstance(value, list) and value and _plain_numbers(value):
                for i, v in enumerate(value):
                    problems += _number_problems(v, lambda i=i, at=at: _path(at, i))  # type: ignore[misc]
                    if len(problems) > 20:
                        break
            elif isinstance(value, dict):
                for k in value:
                    if isinstance(k, Duplicate):
                        where = f" ({k.where})" if k.where else ""
                        problems.append(f"{_path(at, k.key)}: duplicate key{where}; each field may be given "
                                        "once (the later value would silently win)")
                    elif not isinstance(k, str):
                        problems.append(f"{_path(at)}: key {k!r} is not a string; quote it")
            elif isinstance(value, HugeInt):
                problems.append(f"{_path(at)}: an integer with {value.digits} digits; numbers in a config have "
                                f"at most {MAX_INT_DIGITS}")
            elif isinstance(value, bool) or value is None or isinstance(value, list):
                continue
            elif isinstance(value, (int, float)):
                problems += _number_problems(value, lambda at=at: _path(at))  # type: ignore[misc]
            elif isinstance(value, str):
                if len(value) > MAX_STRING:
                    problems.append(f"{_path(at)}: a string of {len(value)} characters; the limit is {MAX_STRING}")
                elif "\0" in value:
                    problems.append(f"{_path(at)}: contains a NUL byte; remove it")
            else:
                kind = _TYPE_HINTS.get(type(value).__name__, type(value).__name__)
                problems.append(f"{_path(at)}: {kind} is not a config value; quote it to make it a string")
    except BudgetExceeded:
        problems.append(f"the config expands to more than {MAX_VALUES:,} values (a YAML alias bomb?); "
                        "anchors and aliases may repeat a value, not multiply it")
    return problems


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _values_at(data: Any, dotted: str) -> Iterator[tuple[str, Any]]:
    """(json path, value) for a dotted path with ``[*]`` over list items."""
    nodes: list[tuple[str, Any]] = [("", data)]
    for part in dotted.split("."):
        star = part.endswith("[*]")
        key = part[:-3] if star else part
        nxt: list[tuple[str, Any]] = []
        for prefix, node in nodes:
            if not isinstance(node, dict) or key not in node:
                continue
            here = f"{prefix}.{key}" if prefix else key
            if star:
                items = node[key] if isinstance(node[key], list) else []
                nxt += [(f"{here}[{i}]", item) for i, item in enumerate(items)]
            else:
                nxt.append((here, node[key]))
        nodes = nxt
    yield from nodes


def check_paths(config: dict[str, Any]) -> list[str]:
    """Path fields without control characters, and an ``output_name`` that is a plain new file name."""
    problems: list[str] = []
    for dotted in PATH_FIELDS:
        for where, value in _values_at(config, dotted):
            if isinstance(value, str) and (m := _CONTROL.search(value)):
                problems.append(f"{where}: contains the control character {m.group(0)!r}; paths may not hold "
                                "control characters")
    name = config.get("output_name")
    if isinstance(name, str) and not _CONTROL.search(name):
        if name in ("", ".", "..") or "/" in name or "\\" in name:
            problems.append(f"output_name: {name!r} is not a file name; give a plain name like "
                            "'compiled.pulsar' (the file goes inside output_dir)")
        elif collision := colliding_artifact(name):
            problems.append(f"output_name: {name!r} is the name of another artifact of the build ({collision}): "
                            "the compiled model and it would overwrite each other; choose another name, e.g. "
                            "'compiled.pulsar'")
    return problems


def _short_list(values: list[int]) -> str:
    text = str(values)
    return text if len(text) <= 60 else text[:56] + "...]"


def check_shapes(config: dict[str, Any]) -> list[str]:
    """``input_shapes`` dims within :data:`MAX_DIM`, and every ``src_extra_shapes`` group small enough
    to hold as float32 (its rank is checked against the model in :mod:`pulsar.preflight`)."""
    problems: list[str] = []
    text = config.get("input_shapes")
    for part in text.split(";") if isinstance(text, str) else []:
        name, _sep, dims = part.rpartition(":")
        big = next((d for d in dims.split("x") if re.fullmatch(r"\s*[0-9]+\s*", d)
                    and (len(d.strip()) > 10 or int(d) > MAX_DIM)), None)
        if big is not None:
            big = big.strip()
            shown = big if len(big) <= 30 else f"of {len(big)} digits"
            problems.append(f"input_shapes: input {name.strip()!r} has a dim {shown}; a dim is at most {MAX_DIM:,}")
    for where, shape in _values_at(config, "input_processors[*].src_extra_shapes[*].shape"):
        if not isinstance(shape, list) or not all(type(d) is int and d > 0 for d in shape):
            continue  # the schema reports it
        elements = 1
        for d in shape:  # stops early: a shape may list many dims
            elements *= d
            if elements * 4 > MAX_SHAPE_BYTES:
                problems.append(f"{where}: {_short_list(shape)} holds more than {MAX_SHAPE_BYTES // 4:,} values "
                                f"({MAX_SHAPE_BYTES >> 30} GiB as float32, the most a shape group may take); give a "
                                "smaller shape")
                break
    return problems
