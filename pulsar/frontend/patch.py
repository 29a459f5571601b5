"""User patches from the config: ``const_processors``, ``op_processors`` and ``quant_op_processors``.

Exported models sometimes bake in a value the user must change before the build can go on (a
Reshape's hard-coded batch of 1, an AveragePool exported with ``ceil_mode=0``). These functions
patch such values in place. Every entry is checked first, against the constant's dtype and shape or
against the operator schema, so that a typo fails here with the config field named instead of as
a wrong result or an obscure error later in the build.
"""

from __future__ import annotations

import logging
import numbers
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper, numpy_helper

from pulsar.errors import PulsarError, did_you_mean
from pulsar.frontend.graph import subgraphs

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


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """The graph and every If / Loop / Scan body below it."""
    yield graph
    for node in graph.node:
        for sub in subgraphs(node):
            yield from _graphs(sub)


# ----------------------------------------------------------------------------------------------------------
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
        const = constants.get(name)
        if const is None:
            raise PulsarError(f"{base}.name: the model has no constant (initializer or Constant node) named "
                              f"'{name}'{did_you_mean(name, constants)}")
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


# ----------------------------------------------------------------------------------------------------------
# op_processors / quant_op_processors

_Coerce = Callable[[Any], Any]
_COERCERS: dict[int, tuple[str, _Coerce]] = {}


def _coercer(kind: int, expected: str) -> Callable[[_Coerce], _Coerce]:
    def register(fn: _Coerce) -> _Coerce:
        _COERCERS[kind] = (expected, fn)
        return fn

    return register


@_coercer(AttributeProto.INT, "an integer, e.g. 1")
def _as_int(v: Any) -> int:
    integral = isinstance(v, numbers.Integral) or (isinstance(v, numbers.Real) and float(v).is_integer())
    if integral and -(2**63) <= int(v) < 2**63:
        return int(v)
    raise ValueError


@_coercer(AttributeProto.FLOAT, "a number, e.g. 0.5")
def _as_float(v: Any) -> float:
    if isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_)):
        return float(v)
    raise ValueError


@_coercer(AttributeProto.STRING, 'a string, e.g. "NOTSET"')
def _as_str(v: Any) -> str:
    if isinstance(v, str):
        return v
    raise ValueError


def _as_list(v: Any, item: _Coerce) -> list[Any]:
    if not isinstance(v, (list, tuple)):
        raise ValueError
    return [item(x) for x in v]


_coercer(AttributeProto.INTS, "a list of integers, e.g. [2, 2]")(lambda v: _as_list(v, _as_int))
_coercer(AttributeProto.FLOATS, "a list of numbers, e.g. [0.5, 1.0]")(lambda v: _as_list(v, _as_float))
_coercer(AttributeProto.STRINGS, 'a list of strings, e.g. ["a", "b"]')(lambda v: _as_list(v, _as_str))

# INT attributes that are on/off switches wherever ONNX defines them: nothing else rejects a 2 there
# (checker, shape inference and onnxruntime all read it as "true"), but the NPU compiler may not.
_FLAGS = frozenset({
    "align_corners", "allowzero", "ceil_mode", "center_point_box", "count_include_pad", "detect_negative",
    "detect_positive", "exclude_outside", "exclusive", "fmod", "input_forget", "is_causal", "keepdims",
    "largest", "linear_before_reset", "new_axis", "noop_with_empty_axes", "reverse", "saturate",
    "select_last_index", "sorted", "training_mode", "transA", "transB", "upper",
})
# STRING attributes with a fixed set of values, by op type ("*": any op).
_CHOICES: dict[str, dict[str, tuple[str, ...]]] = {
    "*": {"auto_pad": ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")},
    "Resize": {"mode": ("nearest", "linear", "cubic"),
               "coordinate_transformation_mode": ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel",
                                                  "align_corners", "asymmetric", "tf_crop_and_resize"),
               "nearest_mode": ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil"),
               "keep_aspect_ratio_policy": ("stretch", "not_larger", "not_smaller")},
    "Pad": {"mode": ("constant", "reflect", "edge", "wrap")},
    "DepthToSpace": {"mode": ("DCR", "CRD")},
    "Gelu": {"approximate": ("none", "tanh")},
    "ScatterElements": {"reduction": ("none", "add", "mul", "max", "min")},
    "ScatterND": {"reduction": ("none", "add", "mul", "max", "min")},
}


def _value_problem(op_type: str, name: str, kind: int, value: Any) -> str | None:
    if kind == AttributeProto.INT and name in _FLAGS and value not in (0, 1):
        return f"{value} is not allowed for {op_type} {name}; use 0 or 1"
    choices = _CHOICES.get(op_type, {}).get(name) or _CHOICES["*"].get(name)
    if kind == AttributeProto.STRING and choices and value not in choices:
        return (f"'{value}' is not a valid {op_type} {name}{did_you_mean(value, choices)}; use one of "
                f"{', '.join(choices)}")
    return None


def _opsets(model: onnx.ModelProto) -> dict[str, int]:
    return {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}


def _schema(model: onnx.ModelProto, node: onnx.NodeProto) -> onnx.defs.OpSchema | None:
    domain = "" if node.domain == "ai.onnx" else node.domain
    version = _opsets(model).get(domain)
    if version is None:
        return None
    try:
        return onnx.defs.get_schema(node.op_type, version, domain)
    except onnx.defs.SchemaError:
        return None


def _guess_kind(value: Any) -> int | None:
    """Attribute type from the value itself: only used for ops without an ONNX schema (custom ops)."""
    if isinstance(value, (list, tuple)):
        kinds = {_guess_kind(v) for v in value}
        lists = {AttributeProto.INT: AttributeProto.INTS, AttributeProto.STRING: AttributeProto.STRINGS}
        if kinds and kinds <= {AttributeProto.INT, AttributeProto.FLOAT}:
            return lists.get(kinds.pop(), AttributeProto.FLOATS) if len(kinds) == 1 else AttributeProto.FLOATS
        return lists.get(kinds.pop()) if len(kinds) == 1 else None
    if isinstance(value, str):
        return AttributeProto.STRING
    if isinstance(value, numbers.Real):
        return AttributeProto.INT if isinstance(value, numbers.Integral) else AttributeProto.FLOAT
    return None


def _shown(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _old_value(node: onnx.NodeProto, name: str, schema: onnx.defs.OpSchema | None) -> str:
    for a in node.attribute:
        if a.name == name:
            return _shown(helper.get_attribute_value(a))
    default = schema.attributes[name].default_value if schema and name in schema.attributes else None
    if default is not None and default.type != AttributeProto.UNDEFINED:
        return _shown(helper.get_attribute_value(default))
    return "(unset)"


def _set_attr(node: onnx.NodeProto, attr: AttributeProto) -> None:
    for a in node.attribute:
        if a.name == attr.name:
            a.CopyFrom(attr)
            return
    node.attribute.append(attr)


def _error_text(exc: Exception) -> str:
    """The useful tail of an onnx / onnxruntime error: its last line, without the '[Category]' prefixes."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__).rsplit("] ", 1)[-1][:300]


class _NodeChecker:
    """Validates one node in isolation: onnx checker, strict shape inference, an onnxruntime session.

    Each check runs on the node before and after the patch; only a check that passed before and
    fails after is reported, so problems the model already had (custom ops, unknown input types)
    are not blamed on the user's patch.
    """

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self._types: dict[str, onnx.TypeProto] | None = None
        self._inits = {t.name: t for g in _graphs(model.graph) for t in g.initializer}
        self._consts = {n.output[0]: n for g in _graphs(model.graph) for n in g.node
                        if n.op_type == "Constant" and n.output}

    def types(self) -> dict[str, onnx.TypeProto]:
        if self._types is None:
            try:
                inferred = onnx.shape_inference.infer_shapes(self.model)
            except Exception:  # too large for one proto, or already broken: use the annotations it has
                inferred = self.model
            self._types = {vi.name: vi.type for g in _graphs(inferred.graph)
                           for vi in [*g.input, *g.value_info, *g.output] if vi.type.WhichOneof("value")}
        return self._types

    def new_problem(self, before: onnx.NodeProto, after: onnx.NodeProto) -> str | None:
        old = self._problems(before)
        for check, problem in self._problems(after).items():
            if check not in old:
                return f"{problem} (found by {check})"
        return None

    def _problems(self, node: onnx.NodeProto) -> dict[str, str]:
        problems: dict[str, str] = {}
        ctx = onnx.checker.C.CheckerContext()
        ctx.ir_version, ctx.opset_imports = self.model.ir_version, _opsets(self.model)
        try:
            onnx.checker.check_node(node, ctx)
        except Exception as exc:
            problems["the onnx checker"] = _error_text(exc)
        single = self._single_node_model(node)
        if single is None:
            return problems
        try:
            onnx.shape_inference.infer_shapes(single, check_type=True, strict_mode=True, data_prop=True)
        except Exception as exc:
            problems["shape inference"] = _error_text(exc)
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.log_severity_level = 4
        try:
            ort.InferenceSession(single.SerializeToString(), options, providers=["CPUExecutionProvider"])
        except Exception as exc:
            problems["onnxruntime"] = _error_text(exc)
        return problems

    def _single_node_model(self, node: onnx.NodeProto) -> onnx.ModelProto | None:
        inputs, inits, nodes = [], [], []
        for name in dict.fromkeys(n for n in node.input if n):
            if name in self._inits:
                inits.append(self._inits[name])
            elif name in self._consts:
                nodes.append(self._consts[name])
            elif name in self.types():
                inputs.append(helper.make_value_info(name, self.types()[name]))
            else:
                return None  # an input of unknown type: nothing to check the node against
        outputs = [onnx.ValueInfoProto(name=o) for o in node.output if o]
        graph = helper.make_graph([*nodes, node], "patched_node", inputs, outputs, initializer=inits)
        return helper.make_model(graph, opset_imports=list(self.model.opset_import),
                                 ir_version=self.model.ir_version, functions=list(self.model.functions))


def _coerce_attrs(model: onnx.ModelProto, node: onnx.NodeProto, attrs: Any, base: str) -> list[AttributeProto]:
    schema = _schema(model, node)
    if schema is None:
        log.warning("%s: no ONNX schema for %s (domain '%s'); attribute types are not checked",
                    base, node.op_type, node.domain)
    if not isinstance(attrs, Mapping) or not attrs:
        raise PulsarError(f"{base}.attrs: expected an object of attribute name -> new value, e.g. "
                          '{"ceil_mode": 1}')
    existing = {a.name: a.type for a in node.attribute}
    domain = "" if node.domain == "ai.onnx" else node.domain
    result = []
    for name, value in attrs.items():
        where = f"{base}.attrs.{name}"
        if schema is not None and name not in schema.attributes:
            known = sorted(schema.attributes)
            raise PulsarError(f"{where}: {node.op_type} (opset {_opsets(model)[domain]}) has no attribute '{name}'"
                              f"{did_you_mean(name, known)}; its attributes are: {', '.join(known) or '(none)'}")
        kind = int(schema.attributes[name].type) if schema is not None else existing.get(name, _guess_kind(value))
        if kind is None:
            raise PulsarError(f"{where}: cannot tell the type of {value!r} for custom op {node.op_type}; give "
                              "an integer, a number, a string or a non-empty list of one of them")
        if kind not in _COERCERS:
            raise PulsarError(f"{where}: attributes of type {AttributeProto.AttributeType.Name(kind)} cannot be "
                              "set by op processors (a Constant's value is patched with const_processors)")
        expected, coerce = _COERCERS[kind]
        try:
            value = coerce(value)
        except ValueError:
            raise PulsarError(f"{where}: {value!r} is not {expected} ({node.op_type} attribute '{name}' is "
                              f"{AttributeProto.AttributeType.Name(kind)})") from None
        problem = _value_problem(node.op_type, name, kind, value)
        if problem:
            raise PulsarError(f"{where}: {problem}")
        result.append(helper.make_attribute(name, value, attr_type=kind))
    return result


def apply_op_processors(model: onnx.ModelProto, processors: Sequence[Any],
                        field: str = "op_processors") -> list[str]:
    """Set node attributes in place; returns one line per attribute changed.

    Works on float and QDQ models alike (``field="quant_op_processors"`` for the latter). Values
    are type-checked against the operator schema and the patched node is validated before it
    replaces the original, so a failing entry leaves its node untouched.
    """
    nodes: dict[str, list[onnx.NodeProto]] = {}
    for graph in _graphs(model.graph):
        for node in graph.node:
            if node.name:
                nodes.setdefault(node.name, []).append(node)
    checker = _NodeChecker(model)
    lines: list[str] = []
    for i, proc in enumerate(processors):
        base, op_name = f"{field}[{i}]", proc.op_name
        if op_name not in nodes:
            raise PulsarError(f"{base}.op_name: the model has no node named '{op_name}'"
                              f"{did_you_mean(op_name, nodes)}; use the node name as shown by netron")
        for node in nodes[op_name]:
            new_attrs = _coerce_attrs(model, node, proc.attrs, base)
            patched = onnx.NodeProto()
            patched.CopyFrom(node)
            for attr in new_attrs:
                _set_attr(patched, attr)
            problem = checker.new_problem(node, patched)
            if problem:
                values = ", ".join(f"{a.name}={_shown(helper.get_attribute_value(a))}" for a in new_attrs)
                raise PulsarError(f"{base}.attrs: {node.op_type} node '{op_name}' is invalid with {values}: "
                                  f"{problem}; choose values this operator accepts")
            schema = _schema(model, node)
            lines.extend(f"op {op_name}: {a.name} {_old_value(node, a.name, schema)} -> "
                         f"{_shown(helper.get_attribute_value(a))}" for a in new_attrs)
            node.CopyFrom(patched)
    return lines
