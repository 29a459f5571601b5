"""Graph passes of the frontend, one module each, registered by name.

A pass takes an ``onnx.ModelProto``, rewrites it in place and returns True if it changed anything;
the pass manager runs them to a fixed point and checks each change in onnxruntime.
"""

from __future__ import annotations

from pulsar.frontend.passes import (  # noqa: F401  (imported to register the passes)
    constant_to_initializer,
    eliminate_dead_nodes,
    explicit_pads,
    fold_affine_into_conv,
    fold_batchnorm,
    fold_constants,
    fold_if,
    fold_pad,
    fuse_gelu,
    fuse_hardsigmoid,
    fuse_hardswish,
    fuse_layernorm,
    fuse_layernorm_any,
    fuse_matmul_add,
    fuse_silu,
    fuse_softmax,
    merge_transpose_reshape,
    remove_identity,
    scalar_range_inputs,
)
from pulsar.frontend.passes.registry import PASSES, Pass, register_pass

# Constants first so folding sees them; an If whose condition folded to a constant inlined next; Range's inputs made scalars once folding knows their shapes; folding before identity removal exposes same-shape Reshapes;
# BN folding needs constant weights; dead-node elimination cleans up after all of them.
# Layout-op merging right after identity removal (it leaves Identity ops for graph outputs);
# affine folding after BN folding (both feed the same conv bias); MatMul+Add -> Gemm after it,
# as the fixed point lets a later Mul still fold into that Gemm.
# Activation / normalization fusions after all folding, so their constants are initializers;
# the numeric LayerNorm recogniser after the pattern one (it only sees what the patterns left);
# HardSwish before HardSigmoid so that x * Relu6(x + 3) / 6 becomes one node, not two.
DEFAULT_PASSES: list[str] = [
    "constant_to_initializer",
    "fold_constants",
    "fold_if",
    "scalar_range_inputs",
    "remove_identity",
    "merge_transpose_reshape",
    "fold_batchnorm",
    "fold_affine_into_conv",
    "explicit_pads",
    "fold_pad",
    "fuse_matmul_add",
    "fuse_layernorm",
    "fuse_layernorm_any",
    "fuse_gelu",
    "fuse_silu",
    "fuse_hardswish",
    "fuse_hardsigmoid",
    "fuse_softmax",
    "eliminate_dead_nodes",
]

__all__ = ["DEFAULT_PASSES", "PASSES", "Pass", "register_pass"]
