"""Calibration datasets: streaming readers for ``quant.input_configs`` (Image, Numpy, Binary, NumpyObject).

Typical use::

    with CalibrationData(inputs, configs) as data:
        for sample in data:          # {input_name: array}, one file read at a time
            session.run(None, sample)
"""

from __future__ import annotations

from pulsar.quant.datasets.calibration import CalibrationData
from pulsar.quant.datasets.formats import FORMATS, Reader, register_format
from pulsar.quant.datasets.safe_pickle import load_numpy_object
from pulsar.quant.datasets.sources import MAX_MEMBER_BYTES, Member, Source, open_source
from pulsar.quant.datasets.spec import DEFAULT_TENSOR, DatasetConfig, InputSpec

__all__ = [
    "DEFAULT_TENSOR",
    "FORMATS",
    "MAX_MEMBER_BYTES",
    "CalibrationData",
    "DatasetConfig",
    "InputSpec",
    "Member",
    "Reader",
    "Source",
    "load_numpy_object",
    "open_source",
    "register_format",
]
