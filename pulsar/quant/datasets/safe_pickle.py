"""Load NumpyObject files (``np.save(f, {"a": arr, ...})``) without letting the pickle run code.

``np.load(..., allow_pickle=True)`` executes whatever callable the pickle names, so a calibration
file from someone else could run commands. Here the ``.npy`` header is parsed with numpy's own
reader and the pickle after it is loaded by an unpickler that resolves only the few numpy globals
needed to rebuild arrays, dtypes and scalars. Names are mapped to objects directly, so not even a
module import is triggered by the file.
"""

from __future__ import annotations

import builtins
import collections
import importlib
import io
import pickle
from typing import Any

import numpy as np
from numpy.lib import format as npy_format

from pulsar.errors import PulsarError


def _numpy_core(sub: str) -> Any:
    """numpy >= 2 keeps its internals in ``numpy._core``, numpy 1.x in ``numpy.core``."""
    for base in ("numpy._core", "numpy.core"):
        try:
            return importlib.import_module(f"{base}.{sub}")
        except ImportError:
            continue
    raise ImportError(f"numpy core module {sub} not found")  # pragma: no cover


def _allowed_globals() -> dict[tuple[str, str], Any]:
    multiarray = _numpy_core("multiarray")
    numeric = _numpy_core("numeric")
    objects = {
        "multiarray._reconstruct": multiarray._reconstruct,
        "multiarray.scalar": multiarray.scalar,
        "numeric._frombuffer": numeric._frombuffer,
    }
    allowed: dict[tuple[str, str], Any] = {}
    for key, obj in objects.items():
        sub, name = key.split(".")
        for base in ("numpy._core", "numpy.core"):  # files from either numpy major version
            allowed[(f"{base}.{sub}", name)] = obj
    allowed[("numpy", "ndarray")] = np.ndarray
    allowed[("numpy", "dtype")] = np.dtype
    for name in ("dict", "list", "tuple", "set", "frozenset"):
        allowed[("builtins", name)] = getattr(builtins, name)
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    return allowed


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that knows only numpy array / dtype / scalar constructors and plain containers."""

    ALLOWED = _allowed_globals()

    def __init__(self, file: io.BytesIO, origin: str) -> None:
        super().__init__(file)
        self.origin = origin

    def find_class(self, module: str, name: str) -> Any:
        obj = self.ALLOWED.get((module, name))
        if obj is None:
            raise PulsarError(
                f"{self.origin}: refusing to load, the pickle names the forbidden global '{module}.{name}' "
                f"(NumpyObject files may hold only numpy arrays in a dict); re-create the file with "
                f"np.save(path, {{'input_name': array, ...}})"
            )
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise PulsarError(f"{self.origin}: persistent ids are not allowed in a NumpyObject file")


def load_numpy_object(data: bytes, origin: str) -> dict[str, np.ndarray]:
    """Parse one NumpyObject ``.npy`` (bytes) into ``{name: ndarray}`` without running any code from it."""
    stream = io.BytesIO(data)
    try:
        version = npy_format.read_magic(stream)
        if version == (1, 0):
            _shape, _fortran, dtype = npy_format.read_array_header_1_0(stream)
        elif version == (2, 0):
            _shape, _fortran, dtype = npy_format.read_array_header_2_0(stream)
        else:
            raise PulsarError(f"{origin}: unsupported .npy format version {version} for a NumpyObject file")
    except PulsarError:
        raise
    except Exception as exc:  # numpy raises ValueError / EOFError for anything malformed
        raise PulsarError(f"{origin}: not a valid .npy file ({exc})") from None
    if not dtype.hasobject:
        raise PulsarError(
            f"{origin}: holds a plain {dtype} array, not a dict of arrays; "
            f"use calibration_format Numpy for plain .npy files"
        )
    try:
        obj = RestrictedUnpickler(stream, origin).load()
    except PulsarError:
        raise
    except Exception as exc:  # truncated / corrupt pickle, bad reconstruct arguments, MemoryError
        raise PulsarError(f"{origin}: corrupt NumpyObject file ({type(exc).__name__}: {exc})") from None
    if isinstance(obj, np.ndarray) and obj.dtype.hasobject and obj.shape == ():
        obj = obj.item()
    if not isinstance(obj, dict):
        raise PulsarError(
            f"{origin}: holds a {type(obj).__name__}, expected a dict {{input_name: array}} "
            f"saved with np.save(path, {{'input': array}})"
        )
    out: dict[str, np.ndarray] = {}
    for key, value in obj.items():
        if not isinstance(key, str):
            raise PulsarError(f"{origin}: dict key {key!r} is not a string (keys are model input names)")
        if isinstance(value, np.generic):
            value = np.asarray(value)
        if not isinstance(value, np.ndarray) or value.dtype.hasobject:
            raise PulsarError(
                f"{origin}: value for '{key}' is a {type(value).__name__}, expected a numeric array"
            )
        out[key] = value
    return out
