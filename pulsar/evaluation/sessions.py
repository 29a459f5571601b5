"""What a metric receives: a session with ``inputs`` (name, shape, dtype) and ``run(feeds)``.

The same small interface for the three models a build evaluates, so a metric plugin never needs to
know which one it scores: the float model and the QDQ model run in onnxruntime (QDQ as float math,
as the Reference mode does), the compiled model in the bit-exact simulator (NPUBackend). A plugin sees
all three in the deployed format (:mod:`pulsar.evaluation.deployed`)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np
import onnxruntime as ort

from pulsar.core.ort_errors import ort_guard
from pulsar.core.ort_options import reference_session_options
from pulsar.core.plugin_session import inference_session
from pulsar.core.tensors import TensorInfo


class MetricSession(Protocol):
    inputs: list[TensorInfo]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


_ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
               "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int8)": np.int8,
               "tensor(uint8)": np.uint8, "tensor(int16)": np.int16, "tensor(uint16)": np.uint16,
               "tensor(bool)": np.bool_}


_FIX = "check the evaluation data given to that input (its values, not only its shape)"


class OrtSession:
    """An ONNX file (or serialized model, ``name`` in messages) in onnxruntime (CPU); ``qdq`` keeps Q/DQ as
    float math (no integer fusion)."""

    def __init__(self, model: str | Path | bytes, *, qdq: bool = False, name: str | Path | None = None) -> None:
        opts = reference_session_options() if qdq else ort.SessionOptions()
        shown = name if name is not None else model if not isinstance(model, bytes) else "the model"
        self._what = f"running {shown}"
        with ort_guard(f"loading {shown}", _FIX):
            self._sess = inference_session(model if isinstance(model, bytes) else str(model), opts,
                                              providers=["CPUExecutionProvider"])
        self.inputs = [TensorInfo(i.name, tuple(d if isinstance(d, int) else -1 for d in i.shape),
                                  np.dtype(_ORT_DTYPES.get(i.type, np.float32))) for i in self._sess.get_inputs()]
        self._names = [o.name for o in self._sess.get_outputs()]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with ort_guard(self._what, _FIX):
            return dict(zip(self._names, self._sess.run(self._names, feeds), strict=True))


class CompiledSession:
    """The compiled model in NPUBackend mode (bit-exact integer simulation)."""

    def __init__(self, path: str | Path) -> None:
        from pulsar.runtime.session import Session

        self._sess = Session(path, mode="NPUBackend", workers=1)
        self.inputs = list(self._sess.inputs)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._sess.run(feeds)
