"""Integer kernels of the virtual NPU (the arithmetic of docs/integer_semantics.md).

A kernel is prepared once per node and then called many times::

    run = KERNELS["QConv"](attrs, consts)   # attrs decoded from onnx, consts: initializer values or None
    outputs = run(inputs)                   # every input value (None for an absent optional input)

``consts[i]`` is the value of input ``i`` when it is an initializer (weights, multipliers, shapes), so
heavy kernels convert it once; ``None`` means the value only arrives at run time (or the optional
input is absent: the run-time value is then ``None`` too). Kernels raise :class:`PulsarError` for a
malformed node; the simulator adds the node name.

Integer ops (domain ``pulsar.int``) and the standard data-movement ops (default domain, registered
under their ONNX names, opset-17 input conventions) share one registry keyed by op type.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from pulsar.core.int_ops import INT_DOMAIN, INT_OPS

STD_DOMAIN = ""

Kernel = Callable[[list[np.ndarray | None]], list[np.ndarray]]
KernelFactory = Callable[[dict[str, Any], list[np.ndarray | None]], Kernel]

KERNELS: dict[str, KernelFactory] = {}
DOMAINS: dict[str, str] = {}


def register(op_type: str, *more: str, domain: str = STD_DOMAIN) -> Callable[[KernelFactory], KernelFactory]:
    """Register a kernel factory for one or more op types of ``domain``; a ``pulsar.int`` op needs its
    schema in pulsar/core/int_ops.py (and the compiler a cost rule, pulsar/compiler/workload.py)."""

    def deco(factory: KernelFactory) -> KernelFactory:
        for name in (op_type, *more):
            if name in KERNELS:
                raise ValueError(f"kernel {name!r} registered twice")
            if domain == INT_DOMAIN and name not in INT_OPS:
                raise ValueError(f"kernel {name!r}: no {INT_DOMAIN} schema in pulsar/core/int_ops.py")
            KERNELS[name] = factory
            DOMAINS[name] = domain
        return factory

    return deco


def supported_ops() -> set[str]:
    """Every op type the simulator can run."""
    return set(KERNELS)


# The family modules register themselves on import.
from pulsar.runtime.kernels import (  # noqa: E402, F401, I001
    conv,
    eltwise,
    floating,
    layernorm,
    lut,
    matmul,
    movement,
    pool,
    softmax,
)

__all__ = ["DOMAINS", "INT_DOMAIN", "KERNELS", "STD_DOMAIN", "Kernel", "KernelFactory", "register",
           "supported_ops"]
