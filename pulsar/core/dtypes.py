"""The numeric formats pulsar quantizes to, as objects: one :class:`DataType` per name a config uses.

Every stage asks this table (the quantizer for grids, the exports for element types, the compiler and
the cost model for widths) instead of spelling bits, ranges and onnx types out again.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
from onnx import TensorProto


@dataclass(frozen=True)
class DataType:
    """One format: an integer grid (bits, signedness, range) or a float format."""

    name: str                  # as configs spell it: U8, S4, FP16 ...
    bits: int
    signed: bool
    qmin: int                  # integer grids: the range; float formats: the finite range
    qmax: int
    compute: type              # numpy type values are computed in (4-bit ones: 8-bit arrays)
    onnx_type: int             # element type in onnx files (INT4 / UINT4: two per byte)
    is_float: bool = False

    @property
    def packed(self) -> bool:
        """Stored narrower than it is computed (4-bit values, two per byte)."""
        return self.bits < 8


def _int(name: str, bits: int, signed: bool, compute: type, onnx_type: int) -> DataType:
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    return DataType(name, bits, signed, lo, hi, compute, onnx_type)


_BF16_MAX = 2**127 * 255 // 128
DATA_TYPES: dict[str, DataType] = {t.name: t for t in (
    _int("S4", 4, True, np.int8, TensorProto.INT4),
    _int("U4", 4, False, np.uint8, TensorProto.UINT4),
    _int("U8", 8, False, np.uint8, TensorProto.UINT8),
    _int("S8", 8, True, np.int8, TensorProto.INT8),
    _int("U16", 16, False, np.uint16, TensorProto.UINT16),
    _int("S16", 16, True, np.int16, TensorProto.INT16),
    _int("S32", 32, True, np.int32, TensorProto.INT32),
    _int("U32", 32, False, np.uint32, TensorProto.UINT32),  # LayerNorm scales only (quant.ln_scale_data_type)
    DataType("FP16", 16, True, -65504, 65504, np.float16, TensorProto.FLOAT16, is_float=True),
    DataType("BF16", 16, True, -_BF16_MAX, _BF16_MAX, ml_dtypes.bfloat16, TensorProto.BFLOAT16, is_float=True),
)}
