"""Open an onnxruntime session on an in-memory model without serializing its large weights.

``InferenceSession(model.SerializeToString())`` copies every weight into the bytes, and onnxruntime
parses them back: on a transformer with a 90 MB embedding table that is most of the time a session
takes to open (0.35 of 0.35 s with graph optimizations off, MiniLM). Here the large initializers
keep their name, type and shape in the model, marked as external data, and their values reach
onnxruntime as ``OrtValue`` views of the numpy arrays (``SessionOptions.add_external_initializers``),
which the session object holds for as long as it lives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import onnx
import onnxruntime as ort
from onnx import numpy_helper

from pulsar.core.graph import assign_fields

LIFT_BYTES = 1 << 16  # initializers at least this large go in as OrtValues
# element types onnxruntime builds an OrtValue from a numpy array of (bfloat16, float8 and 4-bit
# tensors come back from onnx as ml_dtypes arrays, which it refuses): the others stay in the proto
_T = onnx.TensorProto
LIFTABLE = frozenset({_T.FLOAT, _T.DOUBLE, _T.FLOAT16, _T.INT8, _T.UINT8, _T.INT16, _T.UINT16, _T.INT32,
                      _T.UINT32, _T.INT64, _T.UINT64, _T.BOOL})
_LOCATION = "pulsar-external-initializer"  # never read: the OrtValue of the same name replaces it


def raw_size(t: onnx.TensorProto) -> int:
    """Bytes of a raw-data tensor of a :data:`LIFTABLE` type from its dims (reading ``raw_data`` would
    copy it); 0 for any other."""
    if not t.HasField("raw_data") or t.data_type not in LIFTABLE:
        return 0
    return int(math.prod(t.dims)) * int(onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize)


def session_with_lifted_weights(model: onnx.ModelProto, options: ort.SessionOptions, providers: Sequence[str],
                                extra_outputs: Sequence[str] = ()) -> Any:
    """``ort.InferenceSession(model, options, providers)`` for a model whose own weights are in the
    proto (raw data), with ``extra_outputs`` (tensor names) as more graph outputs: onnxruntime infers
    their types. ``options`` must be fresh: the weights are added to it, so options shared with
    another session would hand it these values."""
    g = model.graph
    big = [t for t in g.initializer if raw_size(t) >= LIFT_BYTES and t.data_location != onnx.TensorProto.EXTERNAL]
    names = {t.name for t in big}
    light = onnx.ModelProto()
    assign_fields(light, model, skip="graph")
    assign_fields(light.graph, g, skip="initializer")
    for t in g.initializer:
        if t.name not in names:
            light.graph.initializer.append(t)
            continue
        stub = light.graph.initializer.add(name=t.name, data_type=t.data_type, dims=t.dims,
                                           data_location=onnx.TensorProto.EXTERNAL)
        stub.external_data.add(key="location", value=_LOCATION)
    outputs = {o.name for o in g.output}
    light.graph.output.extend(onnx.ValueInfoProto(name=n) for n in extra_outputs if n not in outputs)
    values = [ort.OrtValue.ortvalue_from_numpy(numpy_helper.to_array(t)) for t in big]
    if values:
        options.add_external_initializers([t.name for t in big], values)
    session = ort.InferenceSession(light.SerializeToString(), options, providers=list(providers))
    session._pulsar_weights = values  # onnxruntime reads the arrays in place: they live with the session
    return session


__all__ = ["LIFTABLE", "LIFT_BYTES", "raw_size", "session_with_lifted_weights"]
