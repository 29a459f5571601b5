"""An onnxruntime-like session for models with operator-plugin nodes.

onnxruntime cannot load a node of a plugin's domain, so the graph is cut at its plugin nodes: each run
of standard nodes between them is one onnxruntime session (built on first use, with the caller's
options), each plugin node runs its numpy forward (:mod:`pulsar.core.custom_ops`). The object answers
``run`` / ``get_inputs`` / ``get_outputs`` as ``onnxruntime.InferenceSession`` does, so every stage that
runs a float or QDQ model in onnxruntime (transformation check, calibration, analysis, CPU subgraphs
of a compiled model) gets it from :func:`inference_session` and needs no other change. A model
without plugin nodes gets a plain ``InferenceSession``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from pulsar.core import custom_ops
from pulsar.core.ort_weights import session_with_lifted_weights


@dataclass(frozen=True)
class _Arg:
    """What ``InferenceSession.get_inputs()`` items carry."""

    name: str
    type: str
    shape: list[int | str | None]


@dataclass
class _Segment:
    nodes: list[onnx.NodeProto]
    inputs: list[str]
    outputs: list[str]
    session: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _PluginStep:
    node: onnx.NodeProto
    op: custom_ops.CustomOp


def _used(node: onnx.NodeProto) -> set[str]:
    """Names a node reads, including the outer-scope names its subgraphs read."""
    names = {i for i in node.input if i}
    for a in node.attribute:
        for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
            inner = {i.name for i in g.input} | {t.name for t in g.initializer}
            for n in g.node:
                names |= _used(n) - inner
                inner |= set(n.output)
    return names


def _arg(vi: onnx.ValueInfoProto) -> _Arg:
    tt = vi.type.tensor_type
    elem = helper.tensor_dtype_to_np_dtype(tt.elem_type) if tt.elem_type else np.dtype(np.float32)
    ort_type = {"float32": "float", "float64": "double"}.get(elem.name, elem.name)
    dims: list[int | str | None] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                                    for d in tt.shape.dim]
    return _Arg(vi.name, f"tensor({ort_type})", dims)


class PluginSession:
    """Runs ``model`` as onnxruntime segments and plugin forwards (see the module docstring)."""

    def __init__(self, model: onnx.ModelProto, options: ort.SessionOptions | None = None,
                 providers: Sequence[str] | None = None) -> None:
        self._model = model
        self._options = options
        self._providers = list(providers or ["CPUExecutionProvider"])
        g = model.graph
        self._inits = {t.name: t for t in g.initializer}
        try:
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False).graph
        except Exception:  # noqa: BLE001 - types then come from the values at run time
            inferred = g
        # typed entries only, inference's over the name-only outputs callers add
        self._types: dict[str, onnx.ValueInfoProto] = {
            v.name: v for v in [*g.output, *inferred.output, *g.input, *inferred.value_info] if v.type.tensor_type.elem_type}
        self._inputs = [_arg(v) for v in g.input if v.name not in self._inits]
        self._outputs = [_arg(v) for v in g.output]
        self._steps = self._plan(g)

    def _plan(self, g: onnx.GraphProto) -> list[_Segment | _PluginStep]:
        steps: list[_Segment | _PluginStep] = []
        run: list[onnx.NodeProto] = []
        for node in g.node:
            op = custom_ops.node_op(node)
            if op is None:
                run.append(node)
                continue
            if run:
                steps.append(_Segment(run, [], []))
                run = []
            steps.append(_PluginStep(node, op))
        if run:
            steps.append(_Segment(run, [], []))
        needed_after: set[str] = {o.name for o in g.output}
        for step in reversed(steps):
            if isinstance(step, _PluginStep):
                needed_after |= {i for i in step.node.input if i}
                continue
            produced = {o for n in step.nodes for o in n.output if o}
            reads = set().union(*(_used(n) for n in step.nodes)) - produced
            step.outputs = sorted(produced & needed_after)
            step.inputs = sorted(r for r in reads if r not in self._inits)
            needed_after = (needed_after - produced) | set(step.inputs)
        return steps

    # ------------------------------------------------------------------ the InferenceSession interface

    def get_inputs(self) -> list[_Arg]:
        return list(self._inputs)

    def get_outputs(self) -> list[_Arg]:
        return list(self._outputs)

    def get_providers(self) -> list[str]:
        return list(self._providers)

    def run(self, output_names: Sequence[str] | None, input_feed: dict[str, Any],
            run_options: Any = None) -> list[np.ndarray]:
        env: dict[str, Any] = dict(input_feed)
        for step in self._steps:
            if isinstance(step, _PluginStep):
                ins = [env.get(i) if i else None for i in step.node.input]
                for i in step.node.input:
                    if i and i not in env and i in self._inits:
                        ins[list(step.node.input).index(i)] = onnx.numpy_helper.to_array(self._inits[i])
                dtypes = [self._dtype(o) for o in step.node.output]
                env.update(zip(step.node.output, custom_ops.run_numpy(step.op, step.node, ins, dtypes), strict=True))
                continue
            if not step.outputs:
                continue
            sess = self._session(step, env)
            feeds = {i: env[i] for i in step.inputs}
            env.update(zip(step.outputs, sess.run(step.outputs, feeds, run_options), strict=True))
        names = [o.name for o in self._outputs] if output_names is None else list(output_names)
        return [env[n] for n in names]

    # ------------------------------------------------------------------ internals

    def _dtype(self, name: str) -> np.dtype[Any] | None:
        vi = self._types.get(name)
        code = vi.type.tensor_type.elem_type if vi is not None else 0
        return helper.tensor_dtype_to_np_dtype(code) if code else None

    def _value_info(self, name: str, value: Any) -> onnx.ValueInfoProto:
        known = self._types.get(name)
        if known is not None and known.type.tensor_type.elem_type:
            return known
        arr = np.asarray(value)
        info: onnx.ValueInfoProto = helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(arr.dtype), None)
        return info

    def _session(self, step: _Segment, env: dict[str, Any]) -> Any:
        with step.lock:
            if step.session is None:
                used = set().union(*(_used(n) for n in step.nodes))
                graph = helper.make_graph(
                    step.nodes, f"{self._model.graph.name}_part", [self._value_info(i, env[i]) for i in step.inputs],
                    [self._types.get(o) or helper.make_empty_tensor_value_info(o) for o in step.outputs],
                    initializer=[t for name, t in self._inits.items() if name in used])
                plugin_domains = {d for d, _ in custom_ops.CUSTOM_OPS}
                m = helper.make_model(graph, opset_imports=[o for o in self._model.opset_import
                                                            if o.domain not in plugin_domains])
                m.ir_version = self._model.ir_version
                step.session = ort.InferenceSession(m.SerializeToString(), self._options, providers=self._providers)
            return step.session


def inference_session(model: onnx.ModelProto | bytes | str | Path, options: ort.SessionOptions | None = None,
                      providers: Sequence[str] | None = None, *, lift_weights: bool = False) -> Any:
    """``onnxruntime.InferenceSession(model, options, providers)``, or a :class:`PluginSession` when the
    model holds operator-plugin nodes. ``lift_weights``: a ModelProto's large weights reach onnxruntime
    without being serialized (:mod:`pulsar.core.ort_weights`); ``options`` must then be fresh."""
    providers = list(providers or ["CPUExecutionProvider"])
    if custom_ops.CUSTOM_OPS:
        proto = model if isinstance(model, onnx.ModelProto) else (
            onnx.ModelProto.FromString(model) if isinstance(model, bytes) else onnx.load(str(model)))
        if custom_ops.plugin_nodes(proto):
            return PluginSession(proto, options, providers)
    if lift_weights and isinstance(model, onnx.ModelProto):
        return session_with_lifted_weights(model, options or ort.SessionOptions(), providers)
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else (
        model if isinstance(model, bytes) else str(model))
    return ort.InferenceSession(source, options, providers=providers)


__all__ = ["PluginSession", "inference_session"]
