"""Calibration method ``InIR``: the ranges a model carries itself (Compass's ``in_ir``).

ONNX's place for them is the graph's ``quantization_annotation``: per tensor, the names of a scale
and a zero-point initializer (keys ``SCALE_TENSOR`` / ``ZERO_POINT_TENSOR``), as exporters of
quantization-aware trained models write it. A tensor's range is the span of its integer grid,
``[(qmin - zp) * scale, (qmax - zp) * scale]``. Tensors without an annotation are ranged by MinMax
(the build says how many).
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import numpy_helper

from pulsar.errors import PulsarError

log = logging.getLogger(__name__)

_QLIMITS = {np.dtype(np.uint8): (0, 255), np.dtype(np.int8): (-128, 127), np.dtype(np.uint16): (0, 65535),
            np.dtype(np.int16): (-32768, 32767)}


def annotated_ranges(model: onnx.ModelProto) -> dict[str, tuple[float, float]]:
    """tensor name -> the range its quantization annotation gives."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    out: dict[str, tuple[float, float]] = {}
    for ann in g.quantization_annotation:
        keys = {p.key: p.value for p in ann.quant_parameter_tensor_names}
        where = f"the model's quantization_annotation of '{ann.tensor_name}'"
        if "SCALE_TENSOR" not in keys:
            raise PulsarError(f"calibration_method InIR: {where} has no SCALE_TENSOR; give one, or use another method")
        try:
            scale = float(numpy_helper.to_array(inits[keys["SCALE_TENSOR"]]).reshape(-1)[0])
            zpt = inits.get(keys.get("ZERO_POINT_TENSOR", ""))
            zp_arr = numpy_helper.to_array(zpt) if zpt is not None else np.zeros(1, np.uint8)
        except KeyError as e:
            raise PulsarError(f"calibration_method InIR: {where} names the initializer {e}, which the model lacks; "
                              "fix the annotation") from None
        limits = _QLIMITS.get(zp_arr.dtype)
        if limits is None or not np.isfinite(scale) or scale <= 0:
            raise PulsarError(f"calibration_method InIR: {where} has scale {scale} and zero point type {zp_arr.dtype}; "
                              "it needs a positive scale and an 8- or 16-bit zero point")
        zp = float(zp_arr.reshape(-1)[0])
        lo, hi = (limits[0] - zp) * scale, (limits[1] - zp) * scale
        out[ann.tensor_name] = (min(lo, 0.0), max(hi, 0.0))
    return out


def model_ranges(source_path: str, model: onnx.ModelProto, names: list[str]) -> dict[str, tuple[float, float]]:
    """The input model's annotations (the frontend's optimizers drop them) and the optimized model's,
    for the calibrated tensors the optimized model still has."""
    source = onnx.load(source_path, load_external_data=False)
    ranges = {**annotated_ranges(source), **annotated_ranges(model)}
    kept = {t: r for t, r in ranges.items() if t in set(names)}
    log.info("calibration InIR: %d tensors annotated in the model, %d of them in the optimized graph", len(ranges),
             len(kept))
    return kept
