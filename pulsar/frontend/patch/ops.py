"""``op_processors`` / ``quant_op_processors``: set operator attributes, type-checked against the
operator schema and validated on the patched node (e.g. an AveragePool exported with ceil_mode=0).
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import AttributeProto, helper

from pulsar.errors import PulsarError, did_you_mean
from pulsar.frontend.patch.common import all_graphs as _graphs

log = logging.getLogger(__name__)

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
