"""The data types are objects (pulsar/core/dtypes.py) and the stages' tables are views of them."""

from __future__ import annotations

import ml_dtypes
import numpy as np
from onnx import helper

from pulsar.core.dtypes import DATA_TYPES
from pulsar.core.float_ops import FLOAT_FORMATS
from pulsar.quant.scheme import BITS, DTYPES


def test_every_config_data_type_is_defined_once():
    from pulsar.config.schema import load_schema

    names: set[str] = set()

    def walk(node):
        if isinstance(node, dict):
            for key in ("data_type", "output_data_type", "weight_data_type"):
                sub = node.get("properties", {}).get(key)
                if sub and "enum" in sub:
                    names.update(sub["enum"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(load_schema())
    assert names - {"FP32"} <= set(DATA_TYPES)


def test_the_integer_ranges_follow_from_bits_and_sign():
    for t in DATA_TYPES.values():
        if t.is_float:
            assert float(ml_dtypes.finfo(t.compute).max) == t.qmax  # the format's largest finite value
            continue
        assert t.qmax - t.qmin == 2**t.bits - 1 and (t.qmin < 0) == t.signed
        stored = np.dtype(helper.tensor_dtype_to_np_dtype(t.onnx_type))
        assert stored.itemsize * 8 == max(t.bits, 8) or t.packed
        assert DTYPES[t.name] == (t.qmin, t.qmax, t.signed, t.compute) and BITS[t.name] == t.bits
    assert set(FLOAT_FORMATS) == {n for n, t in DATA_TYPES.items() if t.is_float}
