"""The ONNX backend node tests, generated from the installed onnx package, and which of them pulsar takes.

``onnx.backend.test.case.node`` holds one generator per operator; each writes a model and input /
expected-output tensors. The wheel does not ship the generated files, so they are made in memory.
A test is *eligible* when every graph input is a tensor of a type pulsar builds for
(:data:`INPUT_TYPES`); the others are counted and listed by type, never built."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import numpy as np
import onnx

# Graph input element types the suite builds (what numpy holds natively): float inputs are calibrated
# and quantized; integer and bool inputs (ids, masks, indices) pass through unquantized. bfloat16,
# float8, 4-bit and string inputs have no numpy dtype for the calibration and run files.
INPUT_TYPES = {getattr(onnx.TensorProto, name): np.dtype(dt).name for name, dt in [
    ("FLOAT", np.float32), ("FLOAT16", np.float16), ("DOUBLE", np.float64), ("INT8", np.int8),
    ("INT16", np.int16), ("INT32", np.int32), ("INT64", np.int64), ("UINT8", np.uint8), ("UINT16", np.uint16),
    ("UINT32", np.uint32), ("UINT64", np.uint64), ("BOOL", np.bool_)]}


@dataclass
class Case:
    name: str
    model: onnx.ModelProto
    inputs: dict[str, np.ndarray]
    expected: list[np.ndarray | object]
    ops: list[str] = field(default_factory=list)

    @property
    def opset(self) -> int:
        return next((o.version for o in self.model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _input_kind(vi: onnx.ValueInfoProto) -> str:
    t = vi.type
    kind = t.WhichOneof("value")
    if kind != "tensor_type":
        return kind or "unknown"
    return INPUT_TYPES.get(t.tensor_type.elem_type, onnx.TensorProto.DataType.Name(t.tensor_type.elem_type).lower())


def ineligible_reason(model: onnx.ModelProto) -> str | None:
    """Why a test is outside the eligible set (an input type pulsar does not build for), else None."""
    inits = {i.name for i in model.graph.initializer}
    kinds = sorted({_input_kind(vi) for vi in model.graph.input if vi.name not in inits} - set(INPUT_TYPES.values()))
    if kinds:
        return "input type " + ", ".join(kinds)
    if not [vi for vi in model.graph.input if vi.name not in inits]:
        return "no graph input"
    return None


def _array(value: object) -> object:
    """Test data as numpy: scalars come as np.float32, some tensors as TensorProto; sequences stay lists."""
    if isinstance(value, np.generic):
        return np.asarray(value)
    if isinstance(value, onnx.TensorProto):
        return onnx.numpy_helper.to_array(value)
    return value


def collect(patterns: list[str] | None = None) -> tuple[list[Case], dict[str, str]]:
    """(eligible cases, {skipped test: why}) for the node tests whose name matches one of ``patterns``."""
    import warnings

    from onnx.backend.test.case.node import collect_testcases

    cases: list[Case] = []
    skipped: dict[str, str] = {}
    with warnings.catch_warnings():  # the generators compute edge cases (overflow, log(0)) on purpose
        warnings.simplefilter("ignore")
        testcases = collect_testcases(None)
    for tc in sorted(testcases, key=lambda t: t.name):
        if tc.kind != "node" or (patterns and not any(fnmatch.fnmatch(tc.name, p) for p in patterns)):
            continue
        model = tc.model
        why = ineligible_reason(model)
        if why is None and not tc.data_sets:
            why = "no data set"
        if why is not None:
            skipped[tc.name] = why
            continue
        ins, outs = tc.data_sets[0]
        inits = {i.name for i in model.graph.initializer}
        names = [vi.name for vi in model.graph.input if vi.name not in inits]
        cases.append(Case(tc.name, model, dict(zip(names, map(_array, ins), strict=False)), list(map(_array, outs)),
                          sorted({n.op_type for n in model.graph.node})))
    return cases, skipped
