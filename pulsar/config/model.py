"""Typed, read-only config objects: the classes of :mod:`pulsar.config.generated`, filled from a dict.

The pipeline reads ``cfg.quant.calibration_method`` instead of ``cfg["quant"]["calibration_method"]``;
a misspelt attribute fails loudly, at run time and under mypy. The classes are generated from the
schema (``python -m pulsar.config.codegen``, see :mod:`pulsar.config.codegen`), one per object node,
named after its ``$defs`` entry; ``to_typed`` walks their fields and annotations, so a field the
schema gains needs only that command.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from functools import cache
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar, get_args, get_origin, get_type_hints

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from pulsar.config.generated import BuildConfig

    D = TypeVar("D", bound=DataclassInstance)


class _Shape(NamedTuple):
    """How to build one field's value: ``obj``, the config class a dict becomes; ``item``, the config
    class a list's dicts become (the list itself becomes a tuple)."""

    obj: type[Any] | None
    item: type[Any] | None


def _members(annotation: Any) -> tuple[Any, ...]:
    """The members of a union annotation (``X | None`` -> X, None), else the annotation alone."""
    if get_origin(annotation) in (typing.Union, types.UnionType):
        return get_args(annotation)
    return (annotation,)


def _config_class(annotation: Any) -> type[Any] | None:
    return next((m for m in _members(annotation) if isinstance(m, type) and dataclasses.is_dataclass(m)), None)


@cache
def _shapes(cls: type[Any]) -> tuple[tuple[str, _Shape], ...]:
    hints = get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        ann = hints[f.name]
        item = next((c for m in _members(ann) if get_origin(m) is tuple for a in get_args(m)
                     if (c := _config_class(a)) is not None), None)
        out.append((f.name, _Shape(_config_class(ann), item)))
    return tuple(out)


def _build(cls: type[D], data: dict[str, Any]) -> D:
    return cls(**{name: _value(data[name], shape) for name, shape in _shapes(cls) if name in data})


def _value(value: Any, shape: _Shape) -> Any:
    if shape.obj is not None and isinstance(value, dict):
        return _build(shape.obj, value)
    if isinstance(value, list):
        item = _Shape(shape.item, None)
        return tuple(_value(v, item) for v in value) if shape.item is not None else tuple(value)
    return value


def to_typed(config: dict[str, Any]) -> BuildConfig:
    """Build the typed ``BuildConfig`` object from a validated, default-filled config dict: nested
    objects become their config classes, lists tuples, fields the dict lacks None."""
    from pulsar.config.generated import BuildConfig  # here, so that codegen runs even when it is broken

    return _build(BuildConfig, config)


def to_dict(obj: Any) -> Any:
    """Inverse of :func:`to_typed` (unset optional fields are dropped)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if getattr(obj, f.name) is not None}
    if isinstance(obj, tuple):
        return [to_dict(v) for v in obj]
    return obj
