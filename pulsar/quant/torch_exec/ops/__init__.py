"""ONNX ops in torch for the fine-tuning executor, one family of ops per module, all in one registry.

Every module of this package is imported (adding an op family is adding a file); :mod:`.nn` first."""

import importlib
import pkgutil

from pulsar.quant.torch_exec.ops import nn  # noqa: F401  (registers its ops)
from pulsar.quant.torch_exec.ops.registry import TORCH_OPS, Call, OpFn, op

for _m in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _m not in ("registry", "nn"):
        importlib.import_module(f"{__name__}.{_m}")

__all__ = ["TORCH_OPS", "Call", "OpFn", "op"]
