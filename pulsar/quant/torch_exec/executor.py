"""Run a quantized graph (or any slice of it) in torch, float or fake-quantized, on ``quant.device``.

The executor interprets the float graph node by node with :mod:`.ops`; in quantized mode every tensor
the QDQ export quantizes is put through :func:`fake_quant` with its parameters from the
:class:`QuantGraph`: activations where they are produced (graph inputs where they are read), weights,
constant operands and biases where they are read. AdaRound rounding variables, LSQ weight changes and
LSQ scale factors are ``torch.nn.Parameter`` objects that the fine-tuning algorithms train; the fine-tuning
stage reads what they learned (:meth:`weight_values`, :meth:`act_values`) into the quantized graph.
"""

from __future__ import annotations

import logging
from collections import ChainMap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from pulsar.core.custom_ops import node_op
from pulsar.core.float_ops import FLOAT_FORMATS
from pulsar.errors import PulsarError
from pulsar.quant.graph import QuantGraph
from pulsar.quant.scheme import TensorQuant, expanded, requantize
from pulsar.quant.torch_exec.fake_quant import (
    fake_quant,
    floor_ste,
    grad_scale,
    lsq_grad_factor,
    rectified_sigmoid,
    rectified_sigmoid_inverse,
)
from pulsar.quant.torch_exec.fallback import OrtNode, PluginNode, node_runner
from pulsar.quant.torch_exec.ops import TORCH_OPS, Call
from pulsar.quant.torch_exec.ops.registry import GraphRunner

Tensor = torch.Tensor
log = logging.getLogger(__name__)


def to_torch(arr: np.ndarray | np.generic, device: torch.device | str = "cpu") -> Tensor:
    """A numpy array as a torch tensor of the same values: unsigned types wider than 8 bits (which
    torch barely computes with) become int64."""
    a = np.asarray(arr)
    if a.dtype.kind == "u" and a.dtype.itemsize > 1:
        a = a.astype(np.int64)
    return torch.from_numpy(np.array(a, copy=True)).to(device)


def to_numpy(t: Tensor, dtype: np.dtype | None = None) -> np.ndarray:
    a = t.detach().cpu().numpy()
    return a if dtype is None else a.astype(dtype)


def _graphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    out: list[onnx.GraphProto] = []
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            out.append(a.g)
        elif a.type == onnx.AttributeProto.GRAPHS:
            out.extend(a.graphs)
    return out


def unsupported_ops(model: onnx.ModelProto | onnx.GraphProto) -> list[str]:
    """Node names / op types the executor cannot run (in the graph and in every subgraph)."""
    graph = model.graph if isinstance(model, onnx.ModelProto) else model
    def in_torch(n: onnx.NodeProto) -> bool:  # an operator plugin's op runs in torch with its torch_forward
        plugin = node_op(n)
        return plugin.torch_forward is not None if plugin is not None else n.op_type in TORCH_OPS or n.op_type == "Constant"

    out = [f"{n.op_type} ({n.name})" for n in graph.node if not in_torch(n)]
    for n in graph.node:
        for g in _graphs(n):
            out += unsupported_ops(g)
    return out


def constant_value(node: onnx.NodeProto) -> np.ndarray:
    """The value of a Constant node, whichever ``value*`` attribute holds it."""
    a = node.attribute[0]
    if a.name == "value":
        return numpy_helper.to_array(a.t)
    if a.name == "sparse_value":
        raise PulsarError(f"Constant node {node.name!r} holds a sparse tensor; the torch executor takes dense ones")
    value = helper.get_attribute_value(a)
    dtype = {"value_float": np.float32, "value_floats": np.float32, "value_int": np.int64,
             "value_ints": np.int64}.get(a.name)
    if dtype is None:
        raise PulsarError(f"Constant node {node.name!r}: {a.name} has no tensor form in torch")
    return np.asarray(value, dtype)


@dataclass
class ActQuant:
    """A scale of an activation grid; LSQ trains ``factor`` (scale = scale0 x factor)."""

    scale0: Tensor
    factor: torch.nn.Parameter | None = None
    g: float = 1.0

    def scale(self) -> Tensor:
        return self.scale0 if self.factor is None else self.scale0 * grad_scale(self.factor, self.g)


@dataclass
class WeightQuant:
    """One weight of the plan: its float value, grid and how it is rounded.

    mode ``nearest``: round to nearest (the default build); ``adaround``: floor + h(V), learned;
    ``lsq``: the weight itself and its per-channel scale factor are learned, rounding to nearest."""

    w: Tensor
    scale0: Tensor
    zero_point: Tensor
    qmin: int
    qmax: int
    axis: int | None
    mode: str = "nearest"
    v: torch.nn.Parameter | None = None        # AdaRound
    hard: bool = False                         # AdaRound: h = [V >= 0] instead of the soft h(V)
    factor: torch.nn.Parameter | None = None   # LSQ scale factor (per channel)
    delta: torch.nn.Parameter | None = None    # LSQ weight change, in steps of the calibrated grid
    g: float = 1.0

    def _shape(self) -> list[int]:
        shape = [1] * self.w.dim()
        if self.axis is not None and self.scale0.dim():
            shape[self.axis] = -1
        return shape

    def scale(self) -> Tensor:
        return self.scale0 if self.factor is None else self.scale0 * grad_scale(self.factor, self.g)

    def value(self) -> Tensor:
        """The float weight: calibrated, or moved by LSQ (in grid steps, so one learning rate fits
        weights of any magnitude)."""
        if self.delta is None:
            return self.w
        return self.w + self.delta * self.scale0.reshape(self._shape())

    def quantized(self) -> Tensor:
        if self.mode != "adaround":
            return fake_quant(self.value(), self.scale(), self.zero_point, self.qmin, self.qmax, self.axis)
        assert self.v is not None
        s = self.scale0.reshape(self._shape())
        z = self.zero_point.reshape(self._shape())
        h = (self.v >= 0).to(self.w.dtype) if self.hard else rectified_sigmoid(self.v)
        q = torch.clamp(floor_ste(self.w / s) + h + z, self.qmin, self.qmax)
        return (q - z) * s

    def start_adaround(self) -> None:
        s = self.scale0.reshape(self._shape())
        rest = self.w / s - torch.floor(self.w / s)
        self.v = torch.nn.Parameter(rectified_sigmoid_inverse(rest))
        self.mode, self.hard = "adaround", False


def _attrs(node: onnx.NodeProto, opset: int) -> dict[str, object]:
    out: dict[str, object] = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    out["_opset"] = opset
    for k, v in list(out.items()):
        if isinstance(v, bytes):
            out[k] = v.decode()
    out["_outputs"] = len(node.output)
    out["_op"] = node.op_type
    return out


_TORCH_FLOATS = {"FP16": torch.float16, "BF16": torch.bfloat16}


class QuantExecutor:
    """Float or fake-quantized execution of a :class:`QuantGraph` in torch."""

    def __init__(self, qg: QuantGraph, device: torch.device | str = "cpu") -> None:
        self.qg, self.device = qg, torch.device(device)
        g = qg.model.graph
        self.nodes = list(g.node)
        self.opset = next((o.version for o in qg.model.opset_import if o.domain in ("", "ai.onnx")), 13)
        self.calls = [_attrs(n, self.opset) for n in self.nodes]
        self.has_graph = [bool(_graphs(n)) for n in self.nodes]
        # nodes torch cannot run: onnxruntime runs them, without a gradient
        self.fallback = {i: node_runner(n, qg.model.opset_import) for i, n in enumerate(self.nodes)
                         if node_op(n) is not None or (n.op_type not in TORCH_OPS and n.op_type != "Constant")}
        # subgraphs: node list and attributes per body, keyed by the id of the (held) body graph
        self._bodies: dict[int, tuple[onnx.GraphProto, list[onnx.NodeProto], list[dict[str, object]]]] = {}
        self._body_fallback: dict[tuple[int, int], OrtNode | PluginNode] = {}
        self.graph_inputs = {i.name for i in g.input}
        self.consts: dict[str, Tensor] = {}
        for t in g.initializer:
            arr = qg.initializer(t.name)
            self.consts[t.name] = self._tensor(arr)
        for n in self.nodes:  # Constant nodes are constants too
            if n.op_type == "Constant":
                self.consts[n.output[0]] = self._tensor(constant_value(n))
        plan = qg.plan
        self.bias_of = {b.tensor: (b.activation, b.weight) for b in plan.biases}
        self.weights: dict[str, WeightQuant] = {}
        for w in plan.weights:
            tq = qg.params.get(w.tensor)
            if tq is not None and not tq.block_size:  # blocked (grouped) weights are not trained
                self.weights[w.tensor] = WeightQuant(self.consts[w.tensor], self._tensor(tq.scale),
                                                     self._tensor(np.asarray(tq.zero_point, np.float32)),
                                                     tq.qmin, tq.qmax, tq.axis)
        self._zps: dict[str, Tensor] = {}
        # QDrop (Wei et al. 2022): while training, each element of a quantized activation keeps its
        # float value with this probability, which flattens the loss for data not seen in training
        self.drop = 0.0
        self._drop_pool: Tensor | None = None
        self._fixed: dict[str, Tensor] = {}
        self.acts: dict[str, ActQuant] = {}
        for name, tq in qg.params.items():
            if tq.kind == "activation" and plan.dominator(name) == name and tq.dtype not in FLOAT_FORMATS:
                self.acts[name] = ActQuant(self._tensor(tq.scale))

    def _tensor(self, arr: np.ndarray | np.generic) -> Tensor:
        return to_torch(arr, self.device)

    # ---- quantizers ----------------------------------------------------------------------------
    def drop_mask(self, x: Tensor) -> Tensor:
        """QDrop's mask for ``x`` (True: keep the float value, probability ``drop``): a window at a
        random offset into a pool of uniform numbers drawn once per size, since drawing a fresh
        number per element costs more than the fake quantizer itself (1M elements: 3 ms against 2)."""
        n = x.numel()
        pool = self._drop_pool
        if pool is None or pool.numel() < 2 * n or pool.device != x.device:
            pool = self._drop_pool = torch.rand(max(2 * n, 1 << 16), device=x.device)
        off = int(torch.randint(0, pool.numel() - n + 1, (1,)))
        return (pool[off:off + n] < self.drop).view(x.shape)

    def act_scale(self, name: str) -> Tensor:
        return self.acts[self.qg.plan.dominator(name)].scale()

    def _zero_point(self, name: str, tq: TensorQuant) -> Tensor:
        zp = self._zps.get(name)
        if zp is None:
            zp = self._zps[name] = self._tensor(np.asarray(tq.zero_point, np.float32))
        return zp

    def _fq(self, name: str, x: Tensor) -> Tensor:
        tq: TensorQuant = self.qg.params[name]
        if tq.dtype in FLOAT_FORMATS:  # an FP16 / BF16 layer's tensor: rounded to the format (straight through)
            rounded = x.to(_TORCH_FLOATS[tq.dtype]).to(x.dtype)
            return x + (rounded - x).detach()
        if tq.kind == "activation":
            y = fake_quant(x, self.act_scale(name), self._zero_point(name, tq), tq.qmin, tq.qmax, None)
            if self.drop and torch.is_grad_enabled():  # QDrop: some elements keep their float value
                y = torch.where(self.drop_mask(x), x, y)
            return y
        if name in self.weights:
            return self.weights[name].quantized()
        if tq.block_size:  # a grouped weight: its values on the blocked grid, fixed
            fixed_w = self._fixed.get(name)
            if fixed_w is None:
                q = requantize(tq, x.detach().cpu().numpy())
                real = (q.astype(np.float64) - expanded(tq, tq.zero_point)) * expanded(tq, tq.scale)
                fixed_w = self._fixed[name] = self._tensor(real.astype(np.float32))
            return fixed_w
        if tq.kind == "bias":
            act, w = self.bias_of[name]
            scale = self.act_scale(act) * self.weights[w].scale()
            if tq.axis is None:  # a bias that does not run along the channels: the finest channel's step
                scale = scale.min()
            return fake_quant(x, scale, torch.zeros_like(scale), tq.qmin, tq.qmax, tq.axis if scale.dim() else None)
        fixed = self._fixed.get(name)
        if fixed is None:  # a constant operand on its calibrated grid: quantized once
            fixed = self._fixed[name] = fake_quant(x, self._tensor(tq.scale), self._zero_point(name, tq), tq.qmin,
                                                   tq.qmax, tq.axis)
        return fixed

    # ---- running -------------------------------------------------------------------------------
    def run(self, nodes: Iterable[int], feeds: dict[str, Tensor], outputs: Sequence[str], *,
            quant: bool) -> dict[str, Tensor]:
        """Run ``nodes`` (indices, in graph order) from ``feeds``; returns ``outputs``. Feeds that are
        graph inputs are quantized when read (other feeds come quantized from their producer)."""
        params = self.qg.params
        env: dict[str, Tensor] = {}
        for k, v in feeds.items():
            env[k] = self._fq(k, v) if quant and k in self.graph_inputs and k in params else v
        for idx in nodes:
            node = self.nodes[idx]
            if node.op_type == "Constant":
                continue
            ins: list[Tensor | None] = []
            for name in node.input:
                if not name:
                    ins.append(None)
                elif name in env:
                    ins.append(env[name])
                else:
                    c = self.consts[name]
                    ins.append(self._fq(name, c) if quant and name in params else c)
            outs: Sequence[Tensor]
            if idx in self.fallback:
                outs = self.fallback[idx](ins)
            else:
                call = Call(self.calls[idx], ins)
                if self.has_graph[idx]:
                    call.run_graph = self._graph_runner(env)
                try:
                    outs = TORCH_OPS[node.op_type](call)
                except NotImplementedError as e:  # a form torch does not run: onnxruntime runs it from now on
                    log.debug("torch executor: %s (%s) runs in onnxruntime: %s", node.name, node.op_type, e)
                    self.fallback[idx] = OrtNode(node, self.qg.model.opset_import)
                    outs = self.fallback[idx](ins)
            for name, val in zip(node.output, outs, strict=False):
                env[name] = self._fq(name, val) if quant and name in params else val
        return {o: env[o] if o in env else feeds[o] if o in feeds else self.consts[o] for o in outputs}

    def _graph_runner(self, scope: Mapping[str, Tensor]) -> GraphRunner:
        def run(graph: onnx.GraphProto, inputs: Sequence[Tensor | None]) -> list[Tensor]:
            return self._run_body(graph, inputs, scope)
        return run

    def _run_body(self, graph: onnx.GraphProto, inputs: Sequence[Tensor | None],
                  scope: Mapping[str, Tensor]) -> list[Tensor]:
        """A subgraph (If branch, Loop / Scan body) in float, the enclosing scope visible."""
        env: ChainMap[str, Tensor] = ChainMap({}, dict(scope), self.consts)
        for t in graph.initializer:
            env[t.name] = self._tensor(numpy_helper.to_array(t))
        for vi, value in zip(graph.input, inputs, strict=False):
            if value is not None:
                env[vi.name] = value
        cached = self._bodies.get(id(graph))
        if cached is None or cached[0] is not graph:  # the graph is held, so its id stays its own
            cached = self._bodies[id(graph)] = (graph, list(graph.node), [_attrs(n, self.opset) for n in graph.node])
        _, body_nodes, body_attrs = cached
        for k, (node, attrs) in enumerate(zip(body_nodes, body_attrs, strict=True)):
            if node.op_type == "Constant":
                env[node.output[0]] = self._tensor(constant_value(node))
                continue
            call = Call(attrs, [env[n] if n else None for n in node.input])
            outs: Sequence[Tensor]
            if node.op_type not in TORCH_OPS or node_op(node) is not None:
                fb = self._body_fallback.get((id(graph), k))
                if fb is None:
                    fb = self._body_fallback[(id(graph), k)] = node_runner(node, self.qg.model.opset_import)
                outs = fb(call.inputs)
            else:
                if _graphs(node):
                    call.run_graph = self._graph_runner(env)
                outs = TORCH_OPS[node.op_type](call)
            for name, val in zip(node.output, outs, strict=False):
                if name:
                    env[name] = val
        return [env[o.name] for o in graph.output]

    def parameter_groups(self, names: Iterable[str]) -> dict[str, list[torch.nn.Parameter]]:
        """Trainable parameters of the weights / activations ``names``, by kind: ``rounding`` (AdaRound
        V), ``weights`` (LSQ weight changes, grid steps) and ``scales`` (LSQ scale factors)."""
        out: dict[str, list[torch.nn.Parameter]] = {"rounding": [], "weights": [], "scales": []}
        for n in names:
            wq = self.weights.get(n)
            if wq is not None:
                for kind, p in (("rounding", wq.v), ("weights", wq.delta), ("scales", wq.factor)):
                    if p is not None:
                        out[kind].append(p)
            aq = self.acts.get(n)
            if aq is not None and aq.factor is not None:
                out["scales"].append(aq.factor)
        return out

    def start_lsq(self, weights: Iterable[str], acts: Iterable[str]) -> None:
        """Make weights, their per-channel scales and the activation scales of ``acts`` trainable."""
        for n in weights:
            wq = self.weights[n]
            wq.delta = torch.nn.Parameter(torch.zeros_like(wq.w))
            wq.factor = torch.nn.Parameter(torch.ones_like(wq.scale0))
            per = wq.w.numel() // max(1, wq.scale0.numel())
            wq.g, wq.mode = lsq_grad_factor(per, wq.qmax), "lsq"
        for n in acts:
            aq = self.acts[n]
            aq.factor = torch.nn.Parameter(torch.ones_like(aq.scale0))

    # ---- results -------------------------------------------------------------------------------
    def weight_values(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(float weight on its final grid or as learned, per-channel scale) of a weight."""
        wq = self.weights[name]
        with torch.no_grad():
            value = wq.quantized() if wq.mode == "adaround" else wq.value().detach()
            scale = wq.scale().detach()
        return value.cpu().numpy().astype(np.float32), scale.cpu().numpy().astype(np.float32)

    def act_values(self, name: str) -> np.ndarray:
        with torch.no_grad():
            return self.acts[name].scale().detach().cpu().numpy().astype(np.float32)

    def set_act_scale(self, name: str, scale: np.ndarray) -> None:
        """Fix an activation scale (rollback, or a learned scale kept)."""
        self.acts[name] = ActQuant(self._tensor(scale))

    def freeze_weight(self, name: str, value: np.ndarray, scale: np.ndarray) -> None:
        """Fix a weight to ``value`` on grid ``scale``, rounded to nearest from now on."""
        wq = self.weights[name]
        self.weights[name] = WeightQuant(self._tensor(value), self._tensor(scale).reshape(wq.scale0.shape),
                                         wq.zero_point, wq.qmin, wq.qmax, wq.axis)
