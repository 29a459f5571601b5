"""Graph passes of the frontend, one module each, registered by name.

A pass takes an ``onnx.ModelProto``, rewrites it in place and returns True if it changed anything;
the pass manager runs them to a fixed point and checks each change in onnxruntime.
"""

from __future__ import annotations

from pulsar.frontend.passes import (  # noqa: F401  (imported to register the passes)
    constant_to_initializer,
    eliminate_dead_nodes,
    fold_batchnorm,
    fold_constants,
    remove_identity,
)
from pulsar.frontend.passes.registry import PASSES, Pass, register_pass

# Constants first so folding sees them; folding before identity removal exposes same-shape Reshapes;
# BN folding needs constant weights; dead-node elimination cleans up after all of them.
DEFAULT_PASSES: list[str] = [
    "constant_to_initializer",
    "fold_constants",
    "remove_identity",
    "fold_batchnorm",
    "eliminate_dead_nodes",
]

__all__ = ["DEFAULT_PASSES", "PASSES", "Pass", "register_pass"]
