"""The public API of operator plugins: a Python file named in the build config's ``op_plugins`` (and given
to ``pulsar run --op_plugin``) registers custom ONNX ops with :func:`register_op`::

    import numpy as np
    from pulsar.plugins import register_op

    @register_op("my.ops", "ClampScale")
    def clamp_scale(x, *, lo=-1.0, hi=1.0, scale=1.0):
        return np.clip(x, lo, hi) * scale

Positional parameters are the node's inputs, keyword-only parameters its attributes (typed by their
default). Optional: ``infer=`` (output shape / dtype from the inputs' :class:`TensorSpec`, when running
the forward on zeros is not right) and ``torch_forward=`` (the same function on torch tensors, so that
fine-tuning gets gradients through the op). A plugin op stays in float on the CPU: calibration, the
quantized model and ``pulsar run`` run its forward.
"""

from __future__ import annotations

from pulsar.core.custom_ops import CustomOp, TensorSpec, load_plugins, lookup, register_op

__all__ = ["CustomOp", "TensorSpec", "load_plugins", "lookup", "register_op"]
