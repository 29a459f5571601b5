"""Float formats an NPU layer may run in (``layer_configs`` data_type FP16 / BF16) and the ops that
can run in them.

Semantics (docs/integer_semantics.md, "Float layers"): every tensor of a float layer holds values of
its format; an op reads them, computes in float32 and rounds each output once to the format (round
to nearest, ties to even). In the QDQ model a tensor on a float grid is written ``T/float -> Cast(to
format) -> T/h -> Cast(to FLOAT) -> T``, the float analogue of a Quantize / Dequantize pair, which
onnxruntime runs as exactly that rounding.
"""

from __future__ import annotations

from pulsar.core.dtypes import DATA_TYPES
from pulsar.core.opdefs import float_layer_ops

# data_type -> (onnx element type, numpy type)
FLOAT_FORMATS: dict[str, tuple[int, type]] = {n: (t.onnx_type, t.compute) for n, t in DATA_TYPES.items()
                                             if t.is_float}
FORMAT_OF_ELEM = {elem: name for name, (elem, _) in FLOAT_FORMATS.items()}

# Standard ops the NPU runs in a float format: the registry's float_layer flag (pulsar/core/opdefs.py);
# each has a float kernel and a cost rule (tests/runtime/test_float_layers.py checks both).
FLOAT_OPS = float_layer_ops()


def float_format(data_type: str) -> bool:
    """Whether ``data_type`` is a float format an NPU layer runs in."""
    return data_type in FLOAT_FORMATS
