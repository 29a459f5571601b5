"""Tensor files: one file per tensor, named after the tensor (``pulsar run``, sample directories).

A tensor's file stem is its name with every character outside ``[A-Za-z0-9_-]`` replaced by
``_`` (``images:0/x`` -> ``images_0_x``), so names from any framework make valid file names.
Inputs are ``<stem>.npy`` (dtype and shape checked) or ``<stem>.bin`` (raw little-endian bytes in
the input's dtype and shape, the form embedded tools write); outputs are always ``<stem>.npy``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from pulsar.core.tensors import TensorInfo, shape_matches
from pulsar.errors import PulsarError
from pulsar.utils.atomic import atomic_save_npy

log = logging.getLogger(__name__)

# Lossless-enough casts users commonly need: numpy writes float64 by default.
_ALLOWED_CASTS = {(np.dtype(np.float64), np.dtype(np.float32))}


def tensor_file_stem(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", name)


def batched(info: TensorInfo, batch_size: int) -> TensorInfo:
    """``info`` for ``batch_size`` compiled batches stacked on axis 0."""
    if batch_size == 1 or not info.shape or info.shape[0] < 1:
        return info
    return TensorInfo(info.name, (info.shape[0] * batch_size, *info.shape[1:]), info.dtype)


def _batch_hint(info: TensorInfo, samples: int | None, batch_size: int) -> str:
    """'; the file holds 4 samples: run with --batch_size 4' when that would make the shape right."""
    b = info.shape[0] if info.shape else 0
    if b < 1 or not samples or samples % b or samples // b == batch_size:
        return ""
    k = samples // b
    what = (f"{k} sample{'s' if k > 1 else ''}" if b == 1 else f"{k} batch{'es' if k > 1 else ''} of {b}")
    return f"; the file holds {what}: run with --batch_size {k}"


def _check_dtype(path: Path, info: TensorInfo, dtype: np.dtype) -> bool:
    """True when values of ``dtype`` must be cast to the input's dtype (an allowed cast)."""
    if dtype == info.dtype:
        return False
    if dtype.newbyteorder("=") == info.dtype or (dtype, info.dtype) in _ALLOWED_CASTS:
        return True
    raise PulsarError(f'{path}: input "{info.name}" expects dtype {info.dtype}, the file holds {dtype}; convert it '
                      "(`pulsar info MODEL` shows what the model takes)")


def _npy_header(path: Path) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype from a .npy header, read before the data (a wrong file is not loaded at all)."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _fortran, dtype = read(f)
    except (ValueError, OSError, EOFError) as exc:
        raise PulsarError(f"{path}: not a plain numeric .npy file ({exc}); save it with np.save") from None
    return tuple(shape), np.dtype(dtype)


def _check_finite(path: Path, info: TensorInfo, array: np.ndarray, allow: str = "") -> np.ndarray:
    """Refuse NaN / infinity; ``allow`` "all" takes both (an input only float ops read: isnan), "inf"
    takes infinities (a -inf mask the float ops absorb before anything is quantized) but not NaN."""
    if array.dtype.kind in "fc" and allow != "all":
        bad = np.isnan(array) if allow == "inf" else ~np.isfinite(array)
        if bad.any():
            first = tuple(int(i) for i in np.argwhere(bad)[0])
            what = "NaN value(s)" if allow == "inf" else "non-finite value(s) (NaN or infinity)"
            raise PulsarError(f'{path}: input "{info.name}" holds {int(bad.sum())} {what}, the first at index '
                              f"{first}; fix the data")
    return array


def _read_npy(path: Path, info: TensorInfo, batch_size: int = 1, allow_nonfinite: str = "") -> np.ndarray:
    want = batched(info, batch_size)
    shape, dtype = _npy_header(path)
    if dtype.hasobject or dtype.fields is not None or dtype.kind not in "biufc":
        raise PulsarError(f"{path}: not a plain numeric .npy file (dtype {dtype}); save it with np.save")
    cast = _check_dtype(path, info, dtype)
    if not shape_matches(want.shape, shape):
        hint = _batch_hint(info, shape[0], batch_size) if len(shape) == len(info.shape) and \
            shape_matches(info.shape[1:], shape[1:]) else ""
        raise PulsarError(f'{path}: input "{info.name}" expects shape {want.shape}, the file holds {shape}{hint}')
    try:
        array = np.load(path, allow_pickle=False)
    except (ValueError, EOFError) as exc:
        raise PulsarError(f"{path}: not a plain numeric .npy file ({exc}); save it with np.save") from None
    except OSError as exc:
        raise PulsarError(f"{path}: cannot read .npy file ({exc})") from None
    if not isinstance(array, np.ndarray):
        raise PulsarError(f"{path}: expected a single array (.npy), got an .npz archive")
    return _check_finite(path, info, array.astype(info.dtype) if cast else array, allow_nonfinite)


def _read_bin(path: Path, info: TensorInfo, batch_size: int = 1, allow_nonfinite: str = "") -> np.ndarray:
    want = batched(info, batch_size)
    size = path.stat().st_size
    itemsize = info.dtype.itemsize
    shape = list(want.shape)
    known = int(np.prod([d for d in shape if d >= 0], dtype=np.int64))
    dynamic = [i for i, d in enumerate(shape) if d < 0]
    if len(dynamic) > 1:
        raise PulsarError(
            f'{path}: input "{info.name}" has shape {info.shape} with several dynamic dimensions; '
            "a raw .bin cannot say its shape, use a .npy file"
        )
    if dynamic:
        count, rest = divmod(size, itemsize * known) if known else (0, 1)
        if rest or not count:
            raise PulsarError(
                f'{path}: {size} bytes is not a whole number of "{info.name}" rows '
                f"(shape {info.shape}, dtype {info.dtype}: {itemsize * known} bytes each)"
            )
        shape[dynamic[0]] = count
    expected = int(np.prod(shape, dtype=np.int64)) * itemsize
    if size != expected:
        per_sample = expected // max(1, shape[0]) if shape and not dynamic else 0
        samples = size // per_sample if per_sample and size % per_sample == 0 else None
        raise PulsarError(
            f'{path}: input "{info.name}" (shape {want.shape}, dtype {info.dtype}) needs exactly '
            f"{expected} bytes, the file has {size}{_batch_hint(info, samples, batch_size)}"
        )
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise PulsarError(f"{path}: cannot read ({exc.strerror or exc})") from None
    raw = np.frombuffer(data, dtype=info.dtype.newbyteorder("<"))
    return _check_finite(path, info, raw.astype(info.dtype).reshape(shape), allow_nonfinite)


def read_inputs(input_dir: str | Path, inputs: list[TensorInfo], *, batch_size: int = 1,
                allow_nonfinite: Mapping[str, str] | None = None) -> dict[str, np.ndarray]:
    """Read one sample: ``<stem>.npy`` or ``<stem>.bin`` per model input from ``input_dir``, holding
    ``batch_size`` compiled batches stacked on axis 0 (``inputs`` are the model's own). NaN and
    infinity are refused except as ``allow_nonfinite`` says per input ("all", or "inf": not NaN)."""
    allow = allow_nonfinite or {}
    input_dir = Path(input_dir)
    if not input_dir.is_dir():
        what = "is not a directory" if input_dir.exists() else "does not exist"
        raise PulsarError(f"input directory {input_dir} {what}")
    feeds: dict[str, np.ndarray] = {}
    for info in inputs:
        stem = tensor_file_stem(info.name)
        npy, raw = input_dir / f"{stem}.npy", input_dir / f"{stem}.bin"
        if npy.is_file() and raw.is_file():
            raise PulsarError(
                f'{input_dir}: both {npy.name} and {raw.name} exist for input "{info.name}"; keep one'
            )
        if npy.is_file():
            feeds[info.name] = _read_npy(npy, info, batch_size, allow.get(info.name, ""))
        elif raw.is_file():
            feeds[info.name] = _read_bin(raw, info, batch_size, allow.get(info.name, ""))
        else:
            expected = ", ".join(f"{tensor_file_stem(i.name)}.npy|.bin" for i in inputs)
            raise PulsarError(
                f'{input_dir}: no file for input "{info.name}" ({npy.name} or {raw.name}); '
                f"expected files: {expected}"
            )
    return feeds


def random_inputs(inputs: list[TensorInfo], seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic random feeds: floats ~ N(0, 1); 8/16-bit ints span their range, wider ints
    (usually indices / ids) stay in [0, 256); dynamic dimensions become 1."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for info in inputs:
        shape = tuple(d if d >= 0 else 1 for d in info.shape)
        dt = info.dtype
        if dt.kind == "f":
            value = rng.standard_normal(shape).astype(dt)
        elif dt.kind == "b":
            value = rng.integers(0, 2, shape).astype(bool)
        elif dt.kind in "iu":
            lo, hi = (np.iinfo(dt).min, np.iinfo(dt).max) if dt.itemsize <= 2 else (0, 255)
            value = rng.integers(lo, hi, shape, endpoint=True).astype(dt)
        else:
            raise PulsarError(f'input "{info.name}": cannot make random data of dtype {dt}; give --input_dir')
        feeds[info.name] = value
    return feeds


def write_outputs(output_dir: str | Path, outputs: dict[str, np.ndarray]) -> list[Path]:
    """Save each output as ``<stem>.npy``; stems that collide get a ``_1``, ``_2``... suffix."""
    output_dir = Path(output_dir)
    written: list[Path] = []
    used: set[str] = set()
    for name, value in outputs.items():
        stem = base = tensor_file_stem(name)
        i = 0
        while stem in used:
            i += 1
            stem = f"{base}_{i}"
        if stem != base:
            log.warning('output "%s" saved as %s.npy (%s.npy is taken by another output)', name, stem, base)
        used.add(stem)
        written.append(atomic_save_npy(output_dir / f"{stem}.npy", value))
    return written
