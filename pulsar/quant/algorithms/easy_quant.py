"""EasyQuant (Wu et al. 2020, arXiv 2006.16669): search scales that keep each layer's output close
to the float one, instead of trusting the calibrated ranges.

Calibration picks a tensor's range from its statistics alone; the scale that best preserves what a
layer computes is often a little different (clipping rare outliers buys resolution for the bulk).
For every quantized Conv / Gemm / MatMul, in graph order:

- The layer runs on its own: its activation inputs are the float model's values for all samples,
  fake-quantized with their *current* Q/DQ parameters (layers do not interact, except that an
  earlier layer's new output scale is a later layer's input scale); weight and bias are dequantized
  from candidate scales; a one-node onnxruntime model (plus the fused Relu / Clip) computes it.
- Objective: cosine between the layer's quantized output ``T`` (after its own Q/DQ) and the float
  model's ``T``, over all samples at once.
- ``rounds`` times: the output scale (factors ``grid`` x current scale), then the weight scales per
  output channel. Given the output scale, output channels are independent, so per-channel dot
  products and energies of each candidate give the exact cosine of any per-channel mix; coordinate
  ascent picks the mix. The current state is always a candidate: a layer's cosine never decreases.

Consistency of the exported model: zero points are kept and scales multiplied (for asymmetric U8
this is the grid of the range scaled by the factor: zero stays exactly representable, the zero
point is unchanged). ``W/q`` is requantized from the float weight with the new scale (factors < 1
clip the largest weights: that is the trade EasyQuant makes); ``B/scale`` = input scale x weight
scale and ``B/q`` are recomputed whenever either changed; passive ops that share ``T``'s grid
(Reshape, MaxPool, ... with equal scale and zero point) follow it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from pulsar.errors import PulsarError, did_you_mean
from pulsar.quant.ops import FUSED_ACTIVATIONS, QUANT_OPS
from pulsar.quant.scheme import MIN_SCALE, bias_quant
from pulsar.runtime.session import reference_session_options, shape_matches, tensor_info

log = logging.getLogger(__name__)

# Searched op types -> the output axis that holds the weight's per-channel axis (output channels).
LAYER_OPS: dict[str, int] = {"Conv": 1, "Gemm": -1, "MatMul": -1}
WEIGHT_INPUT, BIAS_INPUT = 1, 2
ASCENT_SWEEPS = 3


@dataclass
class EasyQuantReport:
    layer: str
    tensor: str
    cosine_before: float
    cosine_after: float
    act_factor: float       # new / original output scale (1.0: output not quantized)
    weight_factor: float    # mean over channels of new / original weight scale (1.0: no quantized weight)


@dataclass
class _QDQ:
    """One DequantizeLinear's parameters: initializer names (the values live in the model)."""

    scale: str
    zero_point: str
    axis: int | None
    output: str          # the dequantized tensor in the QDQ model


@dataclass
class _Const:
    """A quantized constant (weight or bias) of a layer."""

    name: str           # the DequantizeLinear output (= the float model's initializer)
    q: str              # its integer initializer
    qdq: _QDQ
    value: np.ndarray   # float value from the float model


@dataclass
class _Layer:
    node: onnx.NodeProto
    act: onnx.NodeProto | None                # fused Relu / Clip between the op and its output Q/DQ
    inputs: dict[int, tuple[str, _QDQ | None]]  # activation input index -> (float name, its Q/DQ)
    weight: _Const | None                     # searched weight (None: left as exported)
    bias: _Const | None                       # bias kept on the input scale x weight scale grid
    w_scale: str | None                       # the weight's scale initializer (searched or not)
    out: str                                  # compared tensor (float model name)
    out_qdq: _QDQ | None


class _Inits:
    """Initializers of the model being updated, readable as arrays and writable in place."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.protos = {t.name: t for t in model.graph.initializer}
        self.cache: dict[str, np.ndarray] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.protos

    def get(self, name: str) -> np.ndarray:
        if name not in self.cache:
            self.cache[name] = numpy_helper.to_array(self.protos[name])
        return self.cache[name]

    def set(self, name: str, arr: np.ndarray) -> None:
        old = self.get(name)
        arr = np.asarray(arr, dtype=old.dtype).reshape(old.shape)
        self.protos[name].CopyFrom(numpy_helper.from_array(arr, name))
        self.cache[name] = arr


def _qrange(dtype: np.dtype) -> tuple[int, int]:
    info = np.iinfo(dtype)
    return int(info.min), int(info.max)


def _broadcast(scale: np.ndarray, axis: int | None, ndim: int) -> np.ndarray:
    if axis is None or scale.ndim == 0:
        return scale
    shape = [1] * ndim
    shape[axis % ndim] = -1
    return scale.reshape(shape)


def _fake_quant(x: np.ndarray, scale: np.ndarray, zp: np.ndarray, axis: int | None) -> np.ndarray:
    """QuantizeLinear then DequantizeLinear, as onnxruntime computes them (round half to even)."""
    qmin, qmax = _qrange(zp.dtype)
    s = _broadcast(np.asarray(scale, x.dtype), axis, x.ndim)
    z = _broadcast(np.asarray(zp, x.dtype), axis, x.ndim)
    q = np.rint(x / s)
    q += z
    np.clip(q, qmin, qmax, out=q)
    q -= z
    q *= s
    return q


def _quantize_weight(w: np.ndarray, scale: np.ndarray, axis: int | None, dtype: np.dtype,
                     zp: np.ndarray) -> np.ndarray:
    qmin, qmax = _qrange(dtype)
    q = np.rint(w / _broadcast(scale, axis, w.ndim)) + _broadcast(zp.astype(np.float32), axis, w.ndim)
    return np.clip(q, qmin, qmax).astype(dtype)


def _channel_sums(a: np.ndarray, b: np.ndarray, axis: int | None) -> np.ndarray:
    """Sum of a * b per index of ``axis`` (one total when ``axis`` is None), in float64."""
    p = a * b
    if axis is None:
        return np.array([p.sum(dtype=np.float64)])
    axis %= p.ndim
    lead = int(np.prod(p.shape[:axis]))
    return p.reshape(lead, p.shape[axis], -1).sum(axis=(0, 2), dtype=np.float64)


def _cosine(dot: float, qq: float, ff: float) -> float:
    return float(dot / np.sqrt(qq * ff)) if qq > 0 and ff > 0 else 0.0


class _Graph:
    """Who produces / reads what in the QDQ model, and the float model's tensor names."""

    def __init__(self, float_model: onnx.ModelProto, qmodel: onnx.ModelProto, inits: _Inits) -> None:
        self.inits = inits
        self.producer = {o: n for n in qmodel.graph.node for o in n.output}
        self.readers: dict[str, list[onnx.NodeProto]] = {}
        for n in qmodel.graph.node:
            for i in n.input:
                self.readers.setdefault(i, []).append(n)
        fg = float_model.graph
        self.float_inits = {t.name: t for t in fg.initializer}
        self.float_names = {i.name for i in fg.input} | {o for n in fg.node for o in n.output} | set(self.float_inits)

    def float_name(self, name: str) -> str:
        for cand in (name, *(name[: -len(s)] for s in ("/dq", "/float") if name.endswith(s))):
            if cand in self.float_names:
                return cand
        raise PulsarError(f'easy_quant: QDQ model tensor "{name}" has no counterpart in the float model'
                          f"{did_you_mean(name, self.float_names)}; pass the float model the QDQ model was "
                          "exported from")

    def dq_of(self, name: str) -> onnx.NodeProto | None:
        n = self.producer.get(name)
        return n if n is not None and n.op_type == "DequantizeLinear" and len(n.input) == 3 else None

    @staticmethod
    def qdq(dq: onnx.NodeProto) -> _QDQ:
        axis = next((a.i for a in dq.attribute if a.name == "axis"), None)
        return _QDQ(dq.input[1], dq.input[2], int(axis) if axis is not None else None, dq.output[0])

    def only_reader(self, name: str) -> onnx.NodeProto | None:
        users = self.readers.get(name, [])
        return users[0] if len(users) == 1 else None

    def output_qdq(self, name: str) -> onnx.NodeProto | None:
        """The DequantizeLinear of ``name`` -> QuantizeLinear -> DequantizeLinear, if that is its only use."""
        q = self.only_reader(name)
        if q is None or q.op_type != "QuantizeLinear":
            return None
        dq = self.only_reader(q.output[0])
        return dq if dq is not None and dq.op_type == "DequantizeLinear" else None

    def const(self, name: str) -> _Const | None:
        dq = self.dq_of(name)
        if dq is None or dq.input[0] not in self.inits or name not in self.float_inits:
            return None
        return _Const(name, dq.input[0], self.qdq(dq), numpy_helper.to_array(self.float_inits[name]))


def _find_layers(g: _Graph, qmodel: onnx.ModelProto) -> list[_Layer]:
    use_count: dict[str, int] = {}
    for n in qmodel.graph.node:
        for i in set(n.input):
            use_count[i] = use_count.get(i, 0) + 1
    layers = []
    for node in qmodel.graph.node:
        if node.op_type not in LAYER_OPS or node.domain not in ("", "ai.onnx"):
            continue
        act = g.only_reader(node.output[0])
        act = act if act is not None and act.op_type in FUSED_ACTIVATIONS else None
        last = act.output[0] if act is not None else node.output[0]
        out_dq = g.output_qdq(last)
        if out_dq is None:
            act, last = None, node.output[0]
        consts: dict[int, _Const | None] = {}
        inputs: dict[int, tuple[str, _QDQ | None]] = {}
        for k, name in enumerate(node.input):
            if not name or name in g.inits:
                continue
            dq = g.dq_of(name)
            if dq is not None and dq.input[0] in g.inits:  # a quantized constant; shared ones stay as they are
                consts[k] = g.const(name) if use_count.get(name, 0) == 1 else None
            else:
                inputs[k] = (g.float_name(name), g.qdq(dq) if dq is not None else None)
        w_dq = g.dq_of(node.input[WEIGHT_INPUT]) if WEIGHT_INPUT in consts else None
        weight, bias = consts.get(WEIGHT_INPUT), consts.get(BIAS_INPUT)
        if bias is not None and (w_dq is None or inputs.get(0, (None, None))[1] is None):
            bias = None  # its scale is not input scale x weight scale
        if BIAS_INPUT in consts and bias is None:
            weight = None  # the bias could not follow a new weight scale: leave both as exported
        if weight is None and out_dq is None:
            continue
        layers.append(_Layer(node, act, inputs, weight, bias, w_dq.input[1] if w_dq is not None else None,
                             g.float_name(out_dq.output[0] if out_dq else last),
                             g.qdq(out_dq) if out_dq is not None else None))
    return layers


class _FloatValues:
    """Float-model values of the tensors the layers read and compare, for all samples, one run each.
    Samples with equal shapes are concatenated along axis 0 (the batch / row axis of every searched op)."""

    def __init__(self, float_model: onnx.ModelProto, samples: Sequence[dict[str, np.ndarray]],
                 names: list[str]) -> None:
        m = onnx.ModelProto()
        m.CopyFrom(float_model)
        known = {o.name for o in m.graph.output}
        m.graph.output.extend(helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None)
                              for n in names if n not in known)
        sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        runs = [dict(zip(names, sess.run(names, s), strict=True)) for s in samples]
        same = all(r[n].shape == runs[0][n].shape for r in runs for n in names)
        self.values: dict[str, list[np.ndarray]] = {
            n: [np.concatenate([r[n] for r in runs])] if same else [r[n] for r in runs] for n in names}

    def release(self, names: list[str]) -> None:
        for n in names:
            self.values.pop(n, None)


class _Runner:
    """The layer (and its fused activation) as a tiny onnxruntime model: activation inputs, weight and
    bias are fed, other constants copied."""

    def __init__(self, layer: _Layer, qmodel: onnx.ModelProto, inits: _Inits) -> None:
        node = onnx.NodeProto()
        node.CopyFrom(layer.node)
        feeds = dict(layer.inputs)
        if layer.weight is not None:
            feeds[WEIGHT_INPUT] = (layer.weight.name, None)
        if layer.bias is not None:
            feeds[BIAS_INPUT] = (layer.bias.name, None)
        self.feed_names = {k: f"in{k}" for k in feeds}
        consts = [numpy_helper.from_array(inits.get(n), n) for n in node.input
                  if n and n in inits]
        for k in range(len(node.input)):
            if k in feeds:
                node.input[k] = self.feed_names[k]
            elif node.input[k] and node.input[k] not in inits:  # an exported constant left as is
                consts.append(numpy_helper.from_array(self._dq_value(qmodel, inits, node.input[k]),
                                                      node.input[k]))
        nodes = [node]
        if layer.act is not None:
            act = onnx.NodeProto()
            act.CopyFrom(layer.act)
            act.input[0] = node.output[0]
            consts += [numpy_helper.from_array(inits.get(n), n) for n in act.input[1:] if n and n in inits]
            nodes.append(act)
        self.output = nodes[-1].output[0]
        graph = helper.make_graph(
            nodes, "easy_quant_layer",
            [helper.make_tensor_value_info(f, onnx.TensorProto.FLOAT, None) for f in self.feed_names.values()],
            [helper.make_tensor_value_info(self.output, onnx.TensorProto.FLOAT, None)], initializer=consts)
        model = helper.make_model(graph, opset_imports=[o for o in qmodel.opset_import if o.domain in ("", "ai.onnx")])
        model.ir_version = qmodel.ir_version
        self.sess = ort.InferenceSession(model.SerializeToString(), reference_session_options(),
                                         providers=["CPUExecutionProvider"])

    @staticmethod
    def _dq_value(qmodel: onnx.ModelProto, inits: _Inits, name: str) -> np.ndarray:
        dq = next(n for n in qmodel.graph.node if name in n.output)
        axis = next((a.i for a in dq.attribute if a.name == "axis"), None)
        q, s, z = (inits.get(i) for i in dq.input)
        return ((q.astype(np.float64) - _broadcast(z, axis, q.ndim)) * _broadcast(s, axis, q.ndim)).astype(np.float32)

    def __call__(self, acts: dict[int, np.ndarray], w: np.ndarray | None, b: np.ndarray | None) -> np.ndarray:
        feeds = {self.feed_names[k]: v for k, v in acts.items()}
        if w is not None:
            feeds[self.feed_names[WEIGHT_INPUT]] = w
        if b is not None:
            feeds[self.feed_names[BIAS_INPUT]] = b
        return self.sess.run([self.output], feeds)[0]


class _Search:
    """The alternating scale search of one layer; writes the chosen scales into ``inits``."""

    def __init__(self, layer: _Layer, g: _Graph, values: _FloatValues, runner: _Runner,
                 changed: set[str]) -> None:
        self.layer, self.g, self.inits, self.runner, self.changed = layer, g, g.inits, runner, changed
        self.acts = [{k: _fake_quant(v, self.inits.get(q.scale), self.inits.get(q.zero_point), q.axis)
                      if q is not None else v for k, (f, q) in layer.inputs.items()
                      for v in [values.values[f][b]]} for b in range(len(values.values[layer.out]))]
        self.ref = values.values[layer.out]
        self.ff = sum(float(_channel_sums(r, r, None)[0]) for r in self.ref)
        w = layer.weight
        self.w_axis = w.qdq.axis if w is not None else None
        n_ch = self.inits.get(w.qdq.scale).size if w is not None else 1
        out_ch = self.ref[0].shape[LAYER_OPS[layer.node.op_type]] if self.ref[0].ndim else 0
        self.ch_axis = LAYER_OPS[layer.node.op_type] if n_ch > 1 and n_ch == out_ch else None

    def weight_bias(self, w_scale: np.ndarray | None) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Dequantized weight and bias for a weight scale (None: the current one)."""
        layer, inits = self.layer, self.inits
        w = b = None
        if layer.weight is not None:
            c = layer.weight
            scale = inits.get(c.qdq.scale) if w_scale is None else w_scale
            zp = inits.get(c.qdq.zero_point)
            q = _quantize_weight(c.value, scale, c.qdq.axis, zp.dtype, zp)
            w = ((q.astype(np.float32) - _broadcast(zp.astype(np.float32), c.qdq.axis, q.ndim))
                 * _broadcast(scale, c.qdq.axis, q.ndim)).astype(np.float32)
        if layer.bias is not None:
            tq, q = self.bias_quant(w_scale)
            b = (q.astype(np.float64) * tq.scale.reshape(q.shape)).astype(np.float32)
        return w, b

    def bias_quant(self, w_scale: np.ndarray | None) -> tuple:
        layer = self.layer
        in_scale = float(self.inits.get(layer.inputs[0][1].scale))
        scale = self.inits.get(layer.w_scale) if w_scale is None else w_scale
        return bias_quant(layer.bias.name, layer.bias.value, in_scale, scale)

    def outputs(self, w_scale: np.ndarray | None = None) -> list[np.ndarray]:
        w, b = self.weight_bias(w_scale)
        return [self.runner(acts, w, b) for acts in self.acts]

    def quantize_out(self, y: np.ndarray, scale: np.ndarray | None = None) -> np.ndarray:
        q = self.layer.out_qdq
        if q is None:
            return y
        return _fake_quant(y, self.inits.get(q.scale) if scale is None else scale, self.inits.get(q.zero_point), q.axis)

    def stats(self, ys: list[np.ndarray], scale: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Per-channel dot products with the float output and energies of the quantized output."""
        dot = qq = 0.0
        for y, r in zip(ys, self.ref, strict=True):
            yq = self.quantize_out(y, scale)
            dot = dot + _channel_sums(yq, r, self.ch_axis)
            qq = qq + _channel_sums(yq, yq, self.ch_axis)
        return dot, qq

    def act_step(self, factors: np.ndarray) -> tuple[float, float]:
        """Best output scale among factors x current; returns (cosine before, after)."""
        q = self.layer.out_qdq
        s0 = self.inits.get(q.scale)
        ys = self.outputs()
        cands = [np.maximum(s0 * np.float32(f), MIN_SCALE).astype(np.float32) for f in factors]
        cos = [_cosine(*(float(x.sum()) for x in self.stats(ys, s)), self.ff) for s in cands]
        best = int(np.argmax(cos))  # the first max: ties keep the current scale
        if best:
            self.set_act_scale(q, cands[best])
        return cos[0], cos[best]

    def set_act_scale(self, q: _QDQ, scale: np.ndarray) -> None:
        """New scale for ``q``'s tensor and for the passive ops that share its grid."""
        old, zp = self.inits.get(q.scale).copy(), self.inits.get(q.zero_point)
        self.inits.set(q.scale, scale)
        self.changed.add(q.scale)
        for reader in self.g.readers.get(q.output, []):
            if not getattr(QUANT_OPS.get(reader.op_type), "passive", False):
                continue
            for o in reader.output:
                dq = self.g.output_qdq(o)
                if dq is None:
                    continue
                follower = self.g.qdq(dq)
                if (np.array_equal(self.inits.get(follower.scale), old)
                        and np.array_equal(self.inits.get(follower.zero_point), zp)):
                    self.set_act_scale(follower, scale)

    def weight_step(self, factors: np.ndarray) -> tuple[float, float]:
        """Per-channel weight scales (factors x current), coordinate-wise on the exact cosine."""
        s0 = self.inits.get(self.layer.weight.qdq.scale)
        cands = [np.maximum(s0 * np.float32(f), MIN_SCALE).astype(np.float32) for f in factors]
        stats = [self.stats(self.outputs(s)) for s in cands]
        dot = np.stack([d for d, _ in stats])   # (candidates, channels)
        qq = np.stack([e for _, e in stats])
        cols = np.arange(dot.shape[1])

        def objective(choice: np.ndarray) -> float:
            return _cosine(dot[choice, cols].sum(), qq[choice, cols].sum(), self.ff)

        shared = [objective(np.full(len(cols), k)) for k in range(len(cands))]
        choice = np.full(len(cols), int(np.argmax(shared)))
        best = objective(choice)
        for _ in range(10 * ASCENT_SWEEPS):
            # Stationarity of D / sqrt(Q): each channel maximises dot - D / (2Q) * energy.
            d, e = dot[choice, cols].sum(), qq[choice, cols].sum()
            if e <= 0:
                break
            proposal = np.argmax(dot - d / (2 * e) * qq, axis=0)
            value = objective(proposal)
            if value <= best:
                break
            choice, best = proposal, value
        new = np.stack(cands)[choice, cols] if s0.ndim else cands[int(choice[0])]
        if not np.array_equal(new, s0):
            self.set_weight_scale(new)
        return shared[0], max(best, shared[0])

    def set_weight_scale(self, scale: np.ndarray) -> None:
        c = self.layer.weight
        zp = self.inits.get(c.qdq.zero_point)
        self.inits.set(c.qdq.scale, scale)
        self.inits.set(c.q, _quantize_weight(c.value, scale, c.qdq.axis, self.inits.get(c.q).dtype, zp))
        self.changed.add(c.qdq.scale)

    def sync_bias(self) -> None:
        """B/scale = input scale x weight scale, B/q requantized, when either changed."""
        layer = self.layer
        if layer.bias is None or not {layer.inputs[0][1].scale, layer.w_scale} & self.changed:
            return
        tq, q = self.bias_quant(None)
        self.inits.set(layer.bias.qdq.scale, tq.scale)
        self.inits.set(layer.bias.q, q)

    def run(self, factors: np.ndarray, rounds: int) -> EasyQuantReport:
        layer = self.layer
        a0 = self.inits.get(layer.out_qdq.scale).copy() if layer.out_qdq is not None else None
        w0 = self.inits.get(layer.w_scale).copy() if layer.weight is not None else None
        before = after = None
        for _ in range(rounds):
            for step, active in ((self.act_step, a0 is not None), (self.weight_step, w0 is not None)):
                if active:
                    start, after = step(factors)
                    before = start if before is None else before
        self.sync_bias()
        act_factor = float(self.inits.get(layer.out_qdq.scale) / a0) if a0 is not None else 1.0
        weight_factor = float(np.mean(self.inits.get(layer.w_scale) / w0)) if w0 is not None else 1.0
        return EasyQuantReport(layer.node.name, layer.out, float(before), float(after), act_factor, weight_factor)


def _check_args(float_model: onnx.ModelProto, samples: list[dict[str, np.ndarray]], rounds: int,
                grid: np.ndarray) -> None:
    inits = {t.name for t in float_model.graph.initializer}
    infos = {i.name: tensor_info(i) for i in float_model.graph.input if i.name not in inits}
    if not samples:
        raise PulsarError("easy_quant: no samples; pass at least one dict of model inputs (input name -> array)")
    for i, s in enumerate(samples):
        for name in s:
            if name not in infos:
                raise PulsarError(f'easy_quant: sample {i} has unknown input "{name}"{did_you_mean(name, infos)}; '
                                  f"model inputs: {sorted(infos)}")
        for name, info in infos.items():
            if name not in s:
                raise PulsarError(f'easy_quant: sample {i} lacks input "{name}" (shape {info.shape})')
            arr = np.asarray(s[name])
            if arr.dtype != info.dtype or not shape_matches(info.shape, arr.shape):
                raise PulsarError(f'easy_quant: sample {i} input "{name}" is {arr.dtype} {arr.shape}; the model '
                                  f"expects {info.dtype} {info.shape}")
    if rounds < 1:
        raise PulsarError(f"easy_quant: rounds is {rounds}; use 1 or more")
    if grid.size == 0 or not np.all(np.isfinite(grid)) or np.any(grid <= 0):
        raise PulsarError(f"easy_quant: grid {grid.tolist()} must be non-empty positive scale factors")


def easy_quant(float_model: onnx.ModelProto, qdq_model: onnx.ModelProto, samples: Sequence[dict[str, np.ndarray]],
               *, rounds: int = 2, grid: Sequence[float] = np.linspace(0.5, 1.2, 15),
               ) -> tuple[onnx.ModelProto, list[EasyQuantReport]]:
    """Search the output scale and weight scales of every quantized Conv / Gemm / MatMul; returns the
    updated copy of ``qdq_model`` (the input is untouched) and one report row per searched layer.
    ``float_model`` is the model ``qdq_model`` was exported from; ``samples`` are its inputs."""
    samples = list(samples)
    factors = np.concatenate([[1.0], np.asarray(grid, dtype=np.float64).ravel()])
    _check_args(float_model, samples, rounds, factors[1:])
    start = time.perf_counter()
    qmodel = onnx.ModelProto()
    qmodel.CopyFrom(qdq_model)
    inits = _Inits(qmodel)
    g = _Graph(float_model, qmodel, inits)
    layers = _find_layers(g, qmodel)
    last_use: dict[str, int] = {}
    for idx, layer in enumerate(layers):
        for name in [f for f, _ in layer.inputs.values()] + [layer.out]:
            last_use[name] = idx
    values = _FloatValues(float_model, samples, list(last_use))
    changed: set[str] = set()
    reports = []
    for idx, layer in enumerate(layers):
        runner = _Runner(layer, qmodel, inits)
        reports.append(_Search(layer, g, values, runner, changed).run(factors, rounds))
        values.release([n for n, i in last_use.items() if i == idx])
        r = reports[-1]
        log.debug("easy_quant %s: cosine %.6f -> %.6f (act x%.3f, weight x%.3f)", r.layer, r.cosine_before,
                  r.cosine_after, r.act_factor, r.weight_factor)
    if reports:
        log.info("easy_quant: %d layers, mean cosine %.6f -> %.6f in %.1f s", len(reports),
                 np.mean([r.cosine_before for r in reports]), np.mean([r.cosine_after for r in reports]),
                 time.perf_counter() - start)
    return qmodel, reports
