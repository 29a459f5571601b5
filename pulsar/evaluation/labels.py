"""``evaluation.labels`` of the built-in metrics: read safely, checked against the data and the model
before a build writes.

The .npy header is read first, so a header claiming more data than the file holds (10^12 elements in
a small file) or an object array (a pickle) is refused before any memory is taken; the array is then
memory-mapped. Labels that cannot be right are refused rather than scored: a count other than the
number of samples, class indices outside the output's classes, NaN or fractional values in miou
masks, masks of another size than the prediction."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from pulsar.core.tensors import tensor_info
from pulsar.errors import PulsarError

FIELD = "evaluation.labels"
_HEADERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def read_labels(path: str) -> np.ndarray:
    """The labels array, after its header was checked against the file; never unpickles."""
    p = Path(path)
    if not p.is_file():
        raise PulsarError(f"{FIELD}: {path} does not exist; give a .npy file with one label per sample")
    try:
        with open(p, "rb") as f:
            version = np.lib.format.read_magic(f)
            if version not in _HEADERS:
                raise ValueError(f"npy format version {version[0]}.{version[1]} is for structured arrays")
            shape, _, dtype = _HEADERS[version](f)
            offset = f.tell()
        size = p.stat().st_size - offset
    except (ValueError, OSError, SyntaxError) as exc:
        raise PulsarError(f"{FIELD}: {path} is not a plain .npy array ({_first(exc)}); save it with np.save") from None
    if dtype.hasobject or dtype.kind not in "biuf":
        raise PulsarError(f"{FIELD}: {path} holds {dtype} values; labels are numbers (integer class indices), "
                          "save them with np.save(path, np.asarray(labels, np.int64))")
    need = math.prod(shape) * dtype.itemsize
    if need > size:
        raise PulsarError(f"{FIELD}: {path}: its header says {dtype} {list(shape)} ({need:,} bytes) but the file "
                          f"holds {size:,} bytes of data; the file is truncated or damaged: save it again with np.save")
    try:
        labels: np.ndarray = np.load(p, mmap_mode="r" if need else None, allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise PulsarError(f"{FIELD}: {path} is not a plain .npy array ({_first(exc)}); save it with np.save") from None
    return labels


def _first(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def output_shape(model: onnx.ModelProto, name: str) -> tuple[int, ...] | None:
    """The output's shape when every dimension is known (what the label checks compare with)."""
    vi = next((o for o in model.graph.output if o.name == name), None)
    if vi is None or not vi.type.tensor_type.HasField("shape"):
        return None
    shape = tensor_info(vi).shape
    return shape if shape and all(d > 0 for d in shape) else None


def check_labels(metric: str, acc: Any, labels: np.ndarray, path: str, samples: int, output: str,
                 shape: tuple[int, ...] | None) -> None:
    """``labels`` can be right for ``samples`` samples of ``metric`` on the output ``output`` (``shape``)."""
    count = 0 if labels.ndim == 0 else len(labels)
    if count != samples:
        raise PulsarError(f"{FIELD}: {path} holds {count} labels for {samples} samples; give exactly one per sample, "
                          "in sample order")
    if acc.class_labels:
        _class_indices(metric, labels, path, output, shape)
    else:
        _masks(labels, path, output, shape)


def _class_indices(metric: str, labels: np.ndarray, path: str, output: str, shape: tuple[int, ...] | None) -> None:
    if labels.dtype.kind not in "iub" or labels.ndim not in (1, 2) or labels.ndim == 2 and labels.shape[1] != 1:
        raise PulsarError(f"{FIELD}: {path} holds {labels.dtype} labels of shape {list(labels.shape)}; {metric} "
                          "needs one integer class index per sample (shape [N]), not one-hot or float labels: save "
                          "np.argmax(one_hot, 1)")
    classes = math.prod(shape) if shape else None
    _in_range(np.asarray(labels).reshape(-1), classes, path, f"the output {output!r} {list(shape or [])} has "
              f"{classes} classes per sample", "labels are 0-based class indices into the output")


def _masks(labels: np.ndarray, path: str, output: str, shape: tuple[int, ...] | None) -> None:
    flat = np.asarray(labels).reshape(len(labels), -1)
    if labels.dtype.kind == "f":
        bad = ~np.isfinite(flat)
        if bad.any():
            raise PulsarError(f"{FIELD}: {path} holds {int(bad.sum())} NaN / inf values (first in sample "
                              f"{int(np.argwhere(bad)[0][0])}); a miou mask holds one class index per pixel")
        if (flat != np.round(flat)).any():
            raise PulsarError(f"{FIELD}: {path} holds fractional values; a miou mask holds one integer class index "
                              "per pixel")
    if shape is None or len(shape) < 2:
        return
    classes, pixels = shape[1], math.prod(shape) // shape[1]
    if flat.shape[1] != pixels:
        raise PulsarError(f"{FIELD}: {path} holds masks of {list(labels.shape[1:])} ({flat.shape[1]} pixels) per "
                          f"sample; the output {output!r} {list(shape)} predicts {pixels} pixels per sample (class "
                          "axis 1): give one mask of the prediction's size per sample")
    _in_range(flat.reshape(-1), classes, path, f"the output {output!r} {list(shape)} has {classes} classes (axis 1)",
              "a mask holds 0-based class indices")


def _in_range(values: np.ndarray, classes: int | None, path: str, why: str, fix: str) -> None:
    """Every value in 0 .. classes - 1 (only >= 0 when the class count is not known before running)."""
    if not values.size:
        return
    low, high = values.min(), values.max()
    if low >= 0 and (classes is None or high < classes):
        return
    bad = values[(values < 0) | (values >= classes if classes is not None else False)]
    shown = ", ".join(str(int(v)) for v in np.unique(bad)[:4])
    span = f"outside 0..{classes - 1}" if classes is not None else "below 0"
    raise PulsarError(f"{FIELD}: {path} holds {bad.size} class indices {span} ({shown}); {why}: {fix}")
