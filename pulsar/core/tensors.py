"""Model inputs and outputs as name, shape and numpy dtype (what sample files and feeds are checked against)."""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx
from onnx import helper, numpy_helper


@dataclass(frozen=True)
class TensorInfo:
    """A model input or output. A dimension of -1 is dynamic (any size is accepted)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype


def tensor_info(value: onnx.ValueInfoProto) -> TensorInfo:
    t = value.type.tensor_type
    shape = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim)
    return TensorInfo(value.name, shape, np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type)))


def shape_matches(expected: tuple[int, ...], got: tuple[int, ...]) -> bool:
    return len(expected) == len(got) and all(e < 0 or e == g for e, g in zip(expected, got, strict=True))


# 4-bit integer types (onnx INT4 / UINT4, two per byte in a file): computed in 8-bit arrays
_WIDENED_4BIT = {np.dtype(ml_dtypes.int4): np.int8, np.dtype(ml_dtypes.uint4): np.uint8}


def initializer_array(t: onnx.TensorProto) -> np.ndarray:
    """The value of an initializer as numpy computes with it: 4-bit integers (stored packed) come
    back as int8 / uint8, every other type as onnx reads it."""
    arr = numpy_helper.to_array(t)
    wide = _WIDENED_4BIT.get(arr.dtype)
    return arr.astype(wide) if wide is not None else arr
