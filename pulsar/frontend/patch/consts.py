"""``const_processors``: replace a constant's values, checked against its dtype and shape.

Exported models sometimes bake in a value the user must change (a Reshape's hard-coded batch of 1);
every entry is checked first so that a typo fails here, with the config field named.
"""

from __future__ import annotations

import logging
import numbers
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper, numpy_helper

from pulsar.errors import PulsarError, did_you_mean
from pulsar.frontend.patch.common import all_graphs as _graphs

log = logging.getLogger(__name__)

_FLOAT_ELEMS = frozenset(
    getattr(TensorProto, n) for n in ("FLOAT", "DOUBLE", "FLOAT16", "BFLOAT16", "FLOAT8E4M3FN", "FLOAT8E4M3FNUZ",
                                      "FLOAT8E5M2", "FLOAT8E5M2FNUZ", "FLOAT8E8M0", "FLOAT4E2M1")
    if hasattr(TensorProto, n)
)
_PACKED_ELEMS = frozenset(getattr(TensorProto, n) for n in ("INT4", "UINT4", "FLOAT4E2M1", "INT2", "UINT2")
                          if hasattr(TensorProto, n))
# Constant-node attributes other than ``value`` and the element type each one stores.
_CONST_ATTR_ELEMS = {"value_float": TensorProto.FLOAT, "value_floats": TensorProto.FLOAT,
                     "value_int": TensorProto.INT64, "value_ints": TensorProto.INT64,
                     "value_string": TensorProto.STRING, "value_strings": TensorProto.STRING}



# const_processors


class _Const:
    """One patchable constant: an initializer, a Constant node's ``value`` tensor or a ``value_*`` attribute."""

    def __init__(self, name: str, holder: TensorProto | AttributeProto) -> None:
        self.name, self.holder = name, holder
        if isinstance(holder, TensorProto):
            self.elem, self.shape = holder.data_type, tuple(holder.dims)
        else:
            self.elem = _CONST_ATTR_ELEMS[holder.name]
            self.shape = (len(helper.get_attribute_value(holder)),) if holder.name.endswith("s") else ()
        self.dtype = np.dtype(helper.tensor_dtype_to_np_dtype(self.elem))
        self.size = int(np.prod(self.shape, dtype=np.int64))

    def array(self) -> np.ndarray:
        if isinstance(self.holder, TensorProto):
            return numpy_helper.to_array(self.holder)
        return np.array(helper.get_attribute_value(self.holder), dtype=self.dtype)

    def write(self, values: np.ndarray) -> None:
        values = values.reshape(self.shape)
        if isinstance(self.holder, TensorProto):  # also drops any external-data reference
            self.holder.CopyFrom(numpy_helper.from_array(values, self.holder.name))
        else:
            value = values.tolist() if values.ndim else values.item()
            self.holder.CopyFrom(helper.make_attribute(self.holder.name, value, attr_type=self.holder.type))


def _constants(model: onnx.ModelProto) -> dict[str, _Const]:
    found: dict[str, _Const] = {}
    for graph in _graphs(model.graph):
        found.update((t.name, _Const(t.name, t)) for t in graph.initializer)
        for node in graph.node:
            if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or not node.output:
                continue
            for a in node.attribute:
                if a.name == "value":
                    found[node.output[0]] = _Const(node.output[0], a.t)
                elif a.name in _CONST_ATTR_ELEMS:
                    found[node.output[0]] = _Const(node.output[0], a)
    return found


def _input_names(model: onnx.ModelProto) -> list[str]:
    inits = {t.name for t in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in inits]


def _frozen_input(model: onnx.ModelProto, name: str, base: str) -> _Const | None:
    """A model input given a fixed value: it becomes a constant of its own dtype and shape and leaves the
    model's inputs (a sample-rate or mode input fixed for the deployment: control flow on it folds)."""
    vi = next((i for i in model.graph.input if i.name == name), None)
    if vi is None or name in {t.name for t in model.graph.initializer}:
        return None
    t = vi.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else 0 for d in t.shape.dim]
    if not vi.type.HasField("tensor_type") or not t.HasField("shape") or any(d <= 0 for d in dims):
        raise PulsarError(f"{base}.name: input '{name}' has no fixed shape; give it one with input_shapes "
                          f"before fixing its value")
    holder = numpy_helper.from_array(np.zeros(dims, helper.tensor_dtype_to_np_dtype(t.elem_type)), name)
    model.graph.initializer.append(holder)
    model.graph.input.remove(vi)
    log.info("input %s: fixed by %s, no longer a model input", name, base)
    return _Const(name, model.graph.initializer[-1])


def _flatten(data: Any) -> list[Any]:
    if isinstance(data, (list, tuple)):
        return [v for item in data for v in _flatten(item)]
    return [data]


def _from_values(values: list[Any]) -> np.ndarray:
    """Python scalars -> the narrowest exact numpy array (strings stay strings)."""
    if values and all(isinstance(v, (str, bytes)) for v in values):
        return np.array(values, dtype=object)
    for k, v in enumerate(values):
        if isinstance(v, (str, bytes)) or not isinstance(v, numbers.Real):
            raise ValueError(f"value {v!r} (index {k}) is not a number")
    if all(isinstance(v, (bool, np.bool_)) for v in values):
        return np.array(values, dtype=bool)
    if all(isinstance(v, numbers.Integral) for v in values):
        ints = [int(v) for v in values]
        for dtype in (np.int64, np.uint64):
            info = np.iinfo(dtype)
            if all(info.min <= v <= info.max for v in ints):
                return np.array(ints, dtype=dtype)
        k = next(k for k, v in enumerate(ints) if not -(2**63) <= v < 2**63)
        raise ValueError(f"value {ints[k]} (index {k}) is out of range")
    try:
        return np.array([float(v) for v in values], dtype=np.float64)
    except OverflowError as exc:
        raise ValueError("a value is too large for a floating-point number") from exc


def _int_range(dtype: np.dtype) -> tuple[int, int]:
    if dtype == np.bool_:
        return 0, 1
    try:
        info = np.iinfo(dtype)
    except ValueError:  # int4 / uint4 / int2 ... come from ml_dtypes (an onnx dependency)
        import ml_dtypes

        info = ml_dtypes.iinfo(dtype)
    return int(info.min), int(info.max)


def _fit(src: np.ndarray, const: _Const) -> np.ndarray:
    """Cast to the constant's dtype, or raise ValueError naming the first value the cast would change.

    Floats narrowing to a smaller float type are rounded (that is what storing them means); every
    other change (a fraction into an integer, an out-of-range value, an overflow) is refused.
    """
    src, dst = src.reshape(-1), const.dtype
    if dst.kind in "OSU":
        if src.dtype.kind in "OSU" and all(isinstance(v, (str, bytes)) for v in src.tolist()):
            return src.astype(object)
        raise ValueError(f"value {src.tolist()[0]!r} (index 0) is not a string")
    if src.dtype.kind in "OSU":
        raise ValueError(f"value {src.tolist()[0]!r} (index 0) is not a number")
    if src.dtype.kind == "V" or (src.dtype.kind == "c" and dst.kind != "c"):
        raise ValueError(f"values of type {src.dtype} cannot be stored in a {dst} constant")
    with np.errstate(all="ignore"):
        out = src.astype(dst)
        if dst.kind == "c":
            return out
        if const.elem in _FLOAT_ELEMS and src.dtype.kind == "f":
            bad, why = np.isfinite(src) & ~np.isfinite(out.astype(np.float64)), f"is too large for {dst}"
        elif const.elem in _FLOAT_ELEMS:
            bad, why = out.astype(np.float64) != src, f"cannot be stored exactly as {dst}"
        else:
            lo, hi = _int_range(dst)
            bad, why = np.zeros(src.shape, bool), "is not a whole number"
            if src.dtype.kind == "f":
                bad = ~np.isfinite(src) | (np.floor(src) != src)
                out_of_range = (src < lo) | (src >= float(hi) + 1)
            else:
                out_of_range = (src < lo) | (src > hi)
            if not bad.any():
                bad, why = out_of_range, f"is out of range for {dst} [{lo}, {hi}]"
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise ValueError(f"value {src[k].item()!r} (index {k}) {why}")
    return out


_Loader = Callable[[Path, _Const], np.ndarray]
_LOADERS: dict[str, _Loader] = {}


def _loader(suffix: str) -> Callable[[_Loader], _Loader]:
    def register(fn: _Loader) -> _Loader:
        _LOADERS[suffix] = fn
        return fn

    return register


@_loader(".bin")
def _load_bin(path: Path, const: _Const) -> np.ndarray:
    if const.elem in _PACKED_ELEMS or const.dtype.kind in "OSU":
        raise ValueError(f"raw .bin data cannot hold {const.dtype} values; use a .npy file or data")
    raw = path.read_bytes()
    need = const.size * const.dtype.itemsize
    if len(raw) != need:
        raise ValueError(f"has {len(raw)} bytes but constant '{const.name}' ({const.dtype}, shape {list(const.shape)}) "
                         f"needs {need} ({const.size} values x {const.dtype.itemsize} bytes, little-endian)")
    if const.dtype == np.bool_ and max(raw, default=0) > 1:
        raise ValueError("holds a byte other than 0 or 1 for a bool constant")
    dtype = const.dtype.newbyteorder("<") if const.dtype.kind in "iuf" else const.dtype
    return np.frombuffer(raw, dtype=dtype).astype(const.dtype)


@_loader(".npy")
def _load_npy(path: Path, const: _Const) -> np.ndarray:
    try:
        array = np.load(path, allow_pickle=False)
    except (ValueError, EOFError) as exc:
        raise ValueError(f"is not a readable .npy array ({exc})") from exc
    if not isinstance(array, np.ndarray) or array.dtype.names:
        raise ValueError("must hold one plain numeric array (not .npz, not a structured array)")
    return array


@_loader(".txt")
def _load_txt(path: Path, const: _Const) -> np.ndarray:
    try:
        tokens = [t for t in re.split(r"[\s,]+", path.read_text(encoding="utf-8")) if t]
    except UnicodeDecodeError as exc:
        raise ValueError("is not a UTF-8 text file") from exc
    values: list[float | int] = []
    for k, token in enumerate(tokens):
        try:
            values.append(int(token))
        except ValueError:
            try:
                values.append(float(token))
            except ValueError:
                raise ValueError(f"holds '{token[:40]}' (value {k}), which is not a number; write numbers "
                                 "separated by spaces, newlines or commas") from None
    return _from_values(values)


def _read_data_path(raw: Any, const: _Const, where: str) -> np.ndarray:
    path = Path(str(raw))
    loader = _LOADERS.get(path.suffix.lower())
    if loader is None:
        raise PulsarError(f"{where}: '{path}' has an unsupported extension; use one of "
                          f"{', '.join(sorted(_LOADERS))}")
    if not path.is_file():
        raise PulsarError(f"{where}: '{path}' does not exist or is not a file (relative paths start at the "
                          "current directory)")
    try:
        return loader(path, const)
    except OSError as exc:
        raise PulsarError(f"{where}: '{path}' cannot be read ({exc.strerror or exc})") from exc
    except ValueError as exc:
        raise PulsarError(f"{where}: '{path}' {exc}") from exc


def _show(values: np.ndarray, limit: int = 8) -> str:
    flat = values.reshape(-1)
    if flat.dtype.kind not in "biuOSU":
        flat = flat.astype(np.float64)
    items = [v.decode("utf-8", "replace") if isinstance(v, bytes) else f"{v:.6g}" if isinstance(v, float)
             else str(v) for v in flat[:limit].tolist()]
    if values.ndim == 0 and items:
        return items[0]
    text = ", ".join(items) + (", ..." if flat.size > limit else "")
    return f"[{text}]" + (f" ({flat.size} values)" if flat.size > limit else "")


def apply_const_processors(model: onnx.ModelProto, processors: Sequence[Any],
                           field: str = "const_processors") -> list[str]:
    """Replace the values of initializers / Constant nodes in place; returns one line per change.

    Dtype and shape are the model's: the new data must have exactly as many values, each storable
    in the constant's dtype, so a patch cannot silently change what downstream nodes see.
    """
    constants = _constants(model)
    lines: list[str] = []
    for i, proc in enumerate(processors):
        base, name = f"{field}[{i}]", proc.name
        const = constants.get(name) or _frozen_input(model, name, base)
        if const is None:
            raise PulsarError(f"{base}.name: the model has no constant (initializer or Constant node) or input "
                              f"named '{name}'{did_you_mean(name, [*constants, *_input_names(model)])}")
        data, data_path = getattr(proc, "data", None), getattr(proc, "data_path", None)
        if (data is None) == (data_path is None):
            raise PulsarError(f"{base}: give exactly one of data or data_path")
        where = f"{base}.data" if data is not None else f"{base}.data_path"
        try:
            src = _from_values(_flatten(data)) if data is not None else _read_data_path(data_path, const, where)
            if src.size != const.size:
                raise ValueError(f"{src.size} values given but {const.size} expected; give exactly {const.size} "
                                 "values (the shape is kept)")
            new = src.reshape(-1).astype(const.dtype) if src.dtype == const.dtype else _fit(src, const)
        except ValueError as exc:
            kind = "string" if const.dtype.kind == "O" else const.dtype
            raise PulsarError(f"{where}: {exc} (constant '{name}' is {kind}, shape "
                              f"{list(const.shape)})") from exc
        try:
            old = _show(const.array())
        except Exception:  # e.g. external data that was not loaded: the value is not needed, only shown
            old = f"<{const.dtype} {list(const.shape)}>"
        const.write(new)
        lines.append(f"const {name}: {old} -> {_show(new.reshape(const.shape))}")
    return lines

