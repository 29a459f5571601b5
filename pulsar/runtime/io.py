"""Tensor files for ``pulsar run``: one file per tensor, named after the tensor.

A tensor's file stem is its name with every character outside ``[A-Za-z0-9_-]`` replaced by
``_`` (``images:0/x`` -> ``images_0_x``), so names from any framework make valid file names.
Inputs are ``<stem>.npy`` (dtype and shape checked) or ``<stem>.bin`` (raw little-endian bytes in
the input's dtype and shape, the form embedded tools write); outputs are always ``<stem>.npy``.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np

from pulsar.errors import PulsarError
from pulsar.runtime.session import TensorInfo, shape_matches
from pulsar.utils.atomic import atomic_save_npy

log = logging.getLogger(__name__)

# Lossless-enough casts users commonly need: numpy writes float64 by default.
_ALLOWED_CASTS = {(np.dtype(np.float64), np.dtype(np.float32))}


def tensor_file_stem(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", name)


def _read_npy(path: Path, info: TensorInfo) -> np.ndarray:
    try:
        array = np.load(path, allow_pickle=False)
    except ValueError as exc:
        raise PulsarError(f"{path}: not a plain numeric .npy file ({exc}); save it with np.save") from None
    except OSError as exc:
        raise PulsarError(f"{path}: cannot read .npy file ({exc})") from None
    if not isinstance(array, np.ndarray):
        raise PulsarError(f"{path}: expected a single array (.npy), got an .npz archive")
    if array.dtype != info.dtype:
        if (array.dtype, info.dtype) not in _ALLOWED_CASTS:
            raise PulsarError(
                f'{path}: input "{info.name}" expects dtype {info.dtype}, the file holds {array.dtype}'
            )
        array = array.astype(info.dtype)
    if not shape_matches(info.shape, array.shape):
        raise PulsarError(
            f'{path}: input "{info.name}" expects shape {info.shape}, the file holds {array.shape}'
        )
    return array


def _read_bin(path: Path, info: TensorInfo) -> np.ndarray:
    data = path.read_bytes()
    itemsize = info.dtype.itemsize
    shape = list(info.shape)
    known = int(np.prod([d for d in shape if d >= 0], dtype=np.int64))
    dynamic = [i for i, d in enumerate(shape) if d < 0]
    if len(dynamic) > 1:
        raise PulsarError(
            f'{path}: input "{info.name}" has shape {info.shape} with several dynamic dimensions; '
            "a raw .bin cannot say its shape, use a .npy file"
        )
    if dynamic:
        count, rest = divmod(len(data), itemsize * known) if known else (0, 1)
        if rest or not count:
            raise PulsarError(
                f'{path}: {len(data)} bytes is not a whole number of "{info.name}" rows '
                f"(shape {info.shape}, dtype {info.dtype}: {itemsize * known} bytes each)"
            )
        shape[dynamic[0]] = count
    expected = int(np.prod(shape, dtype=np.int64)) * itemsize
    if len(data) != expected:
        raise PulsarError(
            f'{path}: input "{info.name}" (shape {info.shape}, dtype {info.dtype}) needs exactly '
            f"{expected} bytes, the file has {len(data)}"
        )
    raw = np.frombuffer(data, dtype=info.dtype.newbyteorder("<"))
    return raw.astype(info.dtype).reshape(shape)


def read_inputs(input_dir: str | Path, inputs: list[TensorInfo]) -> dict[str, np.ndarray]:
    """Read one sample: ``<stem>.npy`` or ``<stem>.bin`` per model input from ``input_dir``."""
    input_dir = Path(input_dir)
    if not input_dir.is_dir():
        raise PulsarError(f"input directory {input_dir} does not exist")
    feeds: dict[str, np.ndarray] = {}
    for info in inputs:
        stem = tensor_file_stem(info.name)
        npy, raw = input_dir / f"{stem}.npy", input_dir / f"{stem}.bin"
        if npy.is_file() and raw.is_file():
            raise PulsarError(
                f'{input_dir}: both {npy.name} and {raw.name} exist for input "{info.name}"; keep one'
            )
        if npy.is_file():
            feeds[info.name] = _read_npy(npy, info)
        elif raw.is_file():
            feeds[info.name] = _read_bin(raw, info)
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


def read_list_file(list_path: str | Path, input_dir: str | Path) -> list[Path]:
    """Sample directories listed one a line (relative to ``input_dir`` or absolute)."""
    list_path, input_dir = Path(list_path), Path(input_dir)
    if not list_path.is_file():
        raise PulsarError(f"list file {list_path} does not exist")
    dirs: list[Path] = []
    for lineno, line in enumerate(list_path.read_text(encoding="utf-8").splitlines(), start=1):
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        sample = Path(entry) if Path(entry).is_absolute() else input_dir / entry
        if not sample.is_dir():
            raise PulsarError(f"{list_path}:{lineno}: sample directory {sample} does not exist")
        dirs.append(sample)
    if not dirs:
        raise PulsarError(f"list file {list_path} lists no sample directories")
    return dirs
