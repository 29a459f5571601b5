"""Lowering rules, one module per op family; importing this package fills the registry."""

from __future__ import annotations

from pulsar.compiler.lower.rules import conv, eltwise, layernorm, lut, matmul, movement, pool, softmax  # noqa: F401
from pulsar.compiler.lower.rules.base import (
    INT_DOMAIN,
    PASSIVE_OPS,
    RULES,
    LowerCtx,
    Operand,
    Unsupported,
    clamp_of,
    find_rule,
    relu_clip_bounds,
)

__all__ = ["INT_DOMAIN", "PASSIVE_OPS", "RULES", "LowerCtx", "Operand", "Unsupported", "clamp_of", "find_rule",
           "relu_clip_bounds"]
