"""Operator plugins: custom ONNX ops (domain, op type) whose float forward is a user's Python function.

onnxruntime cannot run a Python op without onnxruntime-extensions, so a plugin op is run by pulsar
itself: :mod:`pulsar.core.plugin_session` splits a graph around plugin nodes (onnxruntime for the
standard parts, the plugin's ``forward`` for the custom nodes), the torch executor calls the plugin's
``torch_forward`` (or the numpy forward, without gradient) and the compiler keeps the op on the CPU
(its :class:`~pulsar.core.opdefs.OpDef` is ``cpu_only``). Registration also gives onnx a schema for the
op, so that the checker accepts its attributes and shape inference sees through it: the plugin's
``infer`` function, or else the output shapes of one run of ``forward`` on inputs of the known shapes.

The forward's signature is the op's interface: positional parameters are the node's inputs (``*args``
for any number), keyword-only parameters its attributes, typed by their default value.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.defs import OpSchema

from pulsar.core import opdefs
from pulsar.errors import PulsarError
from pulsar.utils.user_code import describe, load_module

log = logging.getLogger(__name__)

Forward = Callable[..., Any]


@dataclass(frozen=True)
class TensorSpec:
    """What shape inference knows of one input: dims (None where unknown; ``shape`` None when even the
    rank is unknown) and the element type."""

    shape: tuple[int | None, ...] | None
    dtype: np.dtype[Any]


@dataclass(frozen=True)
class CustomOp:
    """One op a plugin registered."""

    domain: str
    op_type: str
    forward: Forward                      # numpy: forward(*inputs, **attributes) -> array or tuple of arrays
    infer: Callable[..., Any] | None      # infer(*TensorSpec, **attributes) -> (shape, dtype) or a list of them
    torch_forward: Forward | None         # torch: the same signature on torch tensors (fine-tuning gradients)
    attributes: dict[str, Any]            # attribute name -> default (inspect.Parameter.empty: required)
    source: str                           # the plugin file (or module) that registered it

    @property
    def name(self) -> str:
        return f"{self.domain}:{self.op_type}"


CUSTOM_OPS: dict[tuple[str, str], CustomOp] = {}
_LOCK = threading.Lock()
_CPU_ONLY = "an operator plugin's op ({}): its float forward runs on the CPU"


def _attribute_type(name: str, default: Any, annotation: Any) -> OpSchema.AttrType:
    """The onnx attribute type of a keyword-only parameter, from its default (or its annotation)."""
    value = default if default is not inspect.Parameter.empty else None
    kinds: list[tuple[Any, OpSchema.AttrType]] = [
        (bool, OpSchema.AttrType.INT), (int, OpSchema.AttrType.INT), (float, OpSchema.AttrType.FLOAT),
        ((str, bytes), OpSchema.AttrType.STRING), (np.ndarray, OpSchema.AttrType.TENSOR)]
    if value is not None:
        if isinstance(value, (list, tuple)):
            first = value[0] if value else 0.0
            return {int: OpSchema.AttrType.INTS, str: OpSchema.AttrType.STRINGS}.get(type(first), OpSchema.AttrType.FLOATS)
        for kind, code in kinds:
            if isinstance(value, kind):
                return code
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    named = {"int": OpSchema.AttrType.INT, "bool": OpSchema.AttrType.INT, "float": OpSchema.AttrType.FLOAT,
             "str": OpSchema.AttrType.STRING, "list[int]": OpSchema.AttrType.INTS,
             "list[float]": OpSchema.AttrType.FLOATS, "list[str]": OpSchema.AttrType.STRINGS}
    if text in named:
        return named[text]
    raise PulsarError(f"operator plugin: attribute {name!r} of the forward needs a default value (or an annotation "
                      "int / float / str / list[int] / list[float] / list[str]) so that pulsar knows its type")


def _signature(forward: Forward, what: str) -> tuple[int, int | None, dict[str, tuple[Any, OpSchema.AttrType]]]:
    """(min inputs, max inputs or None, attribute name -> (default, onnx type)) from ``forward``."""
    try:
        sig = inspect.signature(forward)
    except (TypeError, ValueError) as exc:
        raise PulsarError(f"{what}: forward {forward!r} has no readable signature ({exc})") from None
    lo, hi = 0, 0
    hi_known: int | None = 0
    attrs: dict[str, tuple[Any, OpSchema.AttrType]] = {}
    for p in sig.parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            hi += 1
            lo += p.default is inspect.Parameter.empty
        elif p.kind == p.VAR_POSITIONAL:
            hi_known = None
        elif p.kind == p.KEYWORD_ONLY:
            attrs[p.name] = (p.default, _attribute_type(p.name, p.default, p.annotation))
    return lo, (hi if hi_known is not None else None), attrs


def _schema(op: CustomOp, lo: int, hi: int | None, attrs: dict[str, tuple[Any, OpSchema.AttrType]]) -> OpSchema:
    variadic = OpSchema.FormalParameterOption.Variadic
    types = [f"tensor({t})" for t in ("float16", "float", "double", "bfloat16", "int8", "int16", "int32", "int64",
                                      "uint8", "uint16", "uint32", "uint64", "bool")]
    del hi  # arity is checked when the forward runs: onnx's variadic parameters have no maximum
    schema = OpSchema(op.op_type, op.domain, 1, f"operator plugin op from {op.source}",
                      inputs=[OpSchema.FormalParameter("inputs", "T", param_option=variadic, is_homogeneous=False,
                                                       min_arity=lo)],
                      outputs=[OpSchema.FormalParameter("outputs", "T", param_option=variadic, is_homogeneous=False,
                                                        min_arity=1)],
                      type_constraints=[("T", types, "any tensor")],
                      attributes=[OpSchema.Attribute(name, kind, "", required=default is inspect.Parameter.empty)
                                  for name, (default, kind) in attrs.items()])
    schema.set_type_and_shape_inference_function(lambda ctx: _infer(op, ctx))
    return schema


def register_op(domain: str, op_type: str, forward: Forward | None = None, *, infer: Callable[..., Any] | None = None,
                torch_forward: Forward | None = None) -> Any:
    """Register the custom op ``domain:op_type``; as a decorator (``@register_op("my.ops", "Swish2")``) on
    the numpy forward, or called with ``forward=``. Registering the same op again replaces it."""
    if forward is None:
        def decorate(fn: Forward) -> Forward:
            register_op(domain, op_type, fn, infer=infer, torch_forward=torch_forward)
            return fn
        return decorate
    what = f"operator plugin op {domain}:{op_type}"
    if not isinstance(domain, str) or not isinstance(op_type, str) or not op_type.isidentifier():
        raise PulsarError(f"{what}: domain and op type must be strings, the op type an identifier")
    if domain in ("", "ai.onnx", "ai.onnx.ml", "com.microsoft") or domain.startswith("pulsar"):
        raise PulsarError(f"{what}: the domain {domain or 'ai.onnx'!r} belongs to onnx / onnxruntime / pulsar; give "
                          "your op a domain of your own, e.g. 'my.ops'")
    for fn, role in ((forward, "forward"), (infer, "infer"), (torch_forward, "torch_forward")):
        if fn is not None and not callable(fn):
            raise PulsarError(f"{what}: {role} is a {type(fn).__name__}, not a function")
    lo, hi, attrs = _signature(forward, what)
    source = getattr(inspect.getmodule(forward), "__file__", None) or getattr(forward, "__module__", "?")
    op = CustomOp(domain, op_type, forward, infer, torch_forward, {k: d for k, (d, _) in attrs.items()}, str(source))
    with _LOCK:
        CUSTOM_OPS[(domain, op_type)] = op
        if onnx.defs.has(op_type, domain):
            onnx.defs.deregister_schema(op_type, 1, domain)
        onnx.defs.register_schema(_schema(op, lo, hi, attrs))
        opdefs.OPDEFS[(domain, op_type)] = opdefs.OpDef(op_type, domain, "other",
                                                       cpu_only=_CPU_ONLY.format(Path(str(source)).name))
    return forward


def unregister_op(domain: str, op_type: str) -> None:
    """Forget a registered op (its onnx schema and registry entry too); tests and notebooks use it."""
    with _LOCK:
        if CUSTOM_OPS.pop((domain, op_type), None) is not None:
            opdefs.OPDEFS.pop((domain, op_type), None)
            if onnx.defs.has(op_type, domain):
                onnx.defs.deregister_schema(op_type, 1, domain)


def lookup(domain: str, op_type: str) -> CustomOp | None:
    return CUSTOM_OPS.get((domain, op_type))


def node_op(node: onnx.NodeProto) -> CustomOp | None:
    """The plugin op a node runs, None for any other node."""
    return CUSTOM_OPS.get((node.domain, node.op_type)) if node.domain else None


def load_plugins(paths: Iterable[str | Path], what: str) -> list[Path]:
    """Import every plugin file (each registers its ops when imported); the files, resolved."""
    loaded = []
    for p in paths:
        path = Path(p).expanduser()
        load_module(path, what)
        loaded.append(path.resolve())
    return loaded


# --------------------------------------------------------------------------- running a node


def attributes(node: onnx.NodeProto) -> dict[str, Any]:
    """The node's attributes as Python values (strings decoded, tensors as numpy arrays)."""
    out: dict[str, Any] = {}
    for a in node.attribute:
        value = helper.get_attribute_value(a)
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        elif isinstance(value, list) and value and isinstance(value[0], bytes):
            value = [v.decode("utf-8", "replace") for v in value]
        elif isinstance(value, onnx.TensorProto):
            value = numpy_helper.to_array(value)
        out[a.name] = value
    return out


def _plugin_error(op: CustomOp, node: str, what: str) -> PulsarError:
    return PulsarError(f"operator plugin {Path(op.source).name}: {op.name} on node {node!r} {what}")


def call(op: CustomOp, fn: Forward, node: onnx.NodeProto, inputs: Sequence[Any]) -> list[Any]:
    """``fn(*inputs, **attributes)`` as a list of one value per node output; any failure is one line
    naming the plugin, the op and the node."""
    n_out = len(node.output)
    try:
        result = fn(*inputs, **attributes(node))
    except PulsarError:
        raise
    except Exception as exc:  # noqa: BLE001 - the plugin's own error, on one line
        raise _plugin_error(op, node.name, f"raised {describe(exc)}; fix the plugin's forward") from None
    outs = list(result) if isinstance(result, (tuple, list)) else [result]
    if len(outs) != n_out:
        raise _plugin_error(op, node.name, f"returned {len(outs)} output(s), the node has {n_out}; return one "
                                           "array per output (a tuple for several)")
    return outs


def run_numpy(op: CustomOp, node: onnx.NodeProto, inputs: Sequence[np.ndarray | None],
              dtypes: Sequence[np.dtype[Any] | None] = ()) -> list[np.ndarray]:
    """The node's outputs computed by the plugin's numpy forward, cast to ``dtypes`` where given."""
    with np.errstate(all="ignore"):
        outs = call(op, op.forward, node, inputs)
    arrays = []
    for i, value in enumerate(outs):
        try:
            arr = np.asarray(value)
        except Exception as exc:  # noqa: BLE001 - e.g. a torch tensor that needs .numpy()
            raise _plugin_error(op, node.name, f"returned output {i} as {type(value).__name__} ({describe(exc)}); "
                                               "return numpy arrays") from None
        want = dtypes[i] if i < len(dtypes) else None
        arrays.append(arr.astype(want, copy=False) if want is not None and arr.dtype != want else arr)
    return arrays


# --------------------------------------------------------------------------- shape inference


def _spec(ctx: onnx.shape_inference.InferenceContext, i: int) -> TensorSpec | None:
    t = ctx.get_input_type(i)
    if t is None or not t.HasField("tensor_type") or not t.tensor_type.elem_type:
        return None
    tt = t.tensor_type
    shape = (tuple(d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim)
             if tt.HasField("shape") else None)
    return TensorSpec(shape, helper.tensor_dtype_to_np_dtype(tt.elem_type))


def _set(ctx: onnx.shape_inference.InferenceContext, i: int, shape: Sequence[int | None] | None, dtype: Any) -> None:
    t = onnx.TypeProto()
    t.tensor_type.elem_type = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    if shape is not None:
        t.tensor_type.shape.SetInParent()
        for d in shape:
            dim = t.tensor_type.shape.dim.add()
            if d is not None:
                dim.dim_value = int(d)
    ctx.set_output_type(i, t)


def _infer(op: CustomOp, ctx: onnx.shape_inference.InferenceContext) -> None:
    """Output types for onnx's shape inference; what cannot be inferred stays unknown (never raises:
    a failing forward is reported with its node when it runs)."""
    try:
        attrs = {}
        for name in op.attributes:
            a = ctx.get_attribute(name)
            if a is not None:
                node = helper.make_node("X", [], [])
                node.attribute.append(a)
                attrs[name] = attributes(node)[name]
        n_in = ctx.get_num_inputs()
        specs = [_spec(ctx, i) for i in range(n_in)]
        if op.infer is not None:
            result = op.infer(*specs, **attrs)
            outs = result if isinstance(result, list) else [result]
            for i, (shape, dtype) in enumerate(outs[:ctx.get_num_outputs()]):
                _set(ctx, i, shape, dtype)
            return
        if all(s is not None and s.shape is not None and None not in s.shape for s in specs):
            inputs = []
            for i, s in enumerate(specs):
                data = ctx.get_input_data(i)
                assert s is not None and s.shape is not None
                inputs.append(numpy_helper.to_array(data) if data is not None
                              else np.zeros(tuple(int(d) for d in s.shape if d is not None), s.dtype))
            with np.errstate(all="ignore"):
                outs = op.forward(*inputs, **attrs)
            arrays = [np.asarray(o) for o in (outs if isinstance(outs, (tuple, list)) else [outs])]
            for i, arr in enumerate(arrays[:ctx.get_num_outputs()]):
                _set(ctx, i, arr.shape, arr.dtype)
        elif specs and specs[0] is not None:
            _set(ctx, 0, None, specs[0].dtype)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        log.debug("shape inference of %s failed: %s", op.name, exc)


# --------------------------------------------------------------------------- models


def plugin_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Top-level nodes of ``model`` that a plugin op runs."""
    return [n for n in model.graph.node if node_op(n) is not None]


_ORT_DOMAINS: frozenset[str] | None = None


def ort_domains() -> frozenset[str]:
    """The op domains onnxruntime has kernels for."""
    global _ORT_DOMAINS
    if _ORT_DOMAINS is None:
        from onnxruntime.capi import _pybind_state

        _ORT_DOMAINS = frozenset({s.domain for s in _pybind_state.get_all_operator_schema()} | {"ai.onnx"})
    return _ORT_DOMAINS


def check_known_ops(model: onnx.ModelProto | onnx.GraphProto, where: str,
                    fix: str = "name the file in `op_plugins`") -> None:
    """Refuse a node of a domain neither onnxruntime nor a loaded plugin knows, naming op and node."""
    plugin_domains = {d for d, _ in CUSTOM_OPS}
    known = ort_domains() | plugin_domains
    graph = model.graph if isinstance(model, onnx.ModelProto) else model
    for node in graph.node:
        if node.domain not in known or (node.domain in plugin_domains and node_op(node) is None):
            raise PulsarError(
                f"{where}: node {node.name!r} uses op {node.domain}:{node.op_type}, which neither onnxruntime nor an "
                f"operator plugin defines; write a plugin file that registers it (pulsar.plugins.register_op) and {fix}")


def plugin_files(model: onnx.ModelProto) -> list[dict[str, str]]:
    """One ``{"domain", "op_type", "file"}`` per plugin op ``model`` uses (recorded in compiled models)."""
    seen: dict[tuple[str, str], CustomOp] = {}
    for node in model.graph.node:
        op = node_op(node)
        if op is not None:
            seen.setdefault((op.domain, op.op_type), op)
    return [{"domain": op.domain, "op_type": op.op_type, "file": op.source} for op in seen.values()]


def ensure_plugins(entries: Iterable[Any], where: str) -> None:
    """Load the recorded plugin file of every op in ``entries`` (a compiled model's ``op_plugins``) that no
    plugin has registered yet; a file that is gone is one line naming the op and ``--op_plugin``."""
    for e in entries:
        if not isinstance(e, dict) or lookup(str(e.get("domain")), str(e.get("op_type"))) is not None:
            continue
        name, file = f"{e.get('domain')}:{e.get('op_type')}", Path(str(e.get("file")))
        if not file.is_file():
            raise PulsarError(f"{where}: op {name} needs its operator plugin, recorded as {file}, which does not exist "
                              "here; give the plugin file with --op_plugin FILE (Python: pulsar.plugins.load_plugins)")
        load_module(file, f"{where}: operator plugin of {name}")
        if lookup(str(e.get("domain")), str(e.get("op_type"))) is None:
            raise PulsarError(f"{where}: operator plugin {file} does not register op {name}; give the right file "
                              "with --op_plugin FILE")


__all__ = ["CUSTOM_OPS", "CustomOp", "TensorSpec", "attributes", "call", "check_known_ops", "ensure_plugins", "load_plugins", "lookup",
           "node_op", "ort_domains", "plugin_files", "plugin_nodes", "register_op", "run_numpy",
           "unregister_op"]
