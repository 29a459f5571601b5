"""The pass registry: name -> function that rewrites a model in place and says if it changed it."""

from __future__ import annotations

from collections.abc import Callable

import onnx

Pass = Callable[[onnx.ModelProto], bool]

PASSES: dict[str, Pass] = {}


def register_pass(name: str) -> Callable[[Pass], Pass]:
    """Register ``fn`` under ``name``; a second registration of a name replaces the first."""

    def decorator(fn: Pass) -> Pass:
        PASSES[name] = fn
        return fn

    return decorator
