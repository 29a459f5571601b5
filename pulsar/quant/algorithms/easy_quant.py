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
  model's ``T``, over all samples at once. The float values every layer reads and compares are
  taken in one pass over the samples and kept in memory until their last layer is done.
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
from pulsar.quant.scheme import MIN_SCALE, TensorQuant, bias_quant
from pulsar.runtime.session import reference_session_options, shape_matches, tensor_info

log = logging.getLogger(__name__)

# Searched op types -> the output axis that holds the weight's per-channel axis (output channels).
LAYER_OPS: dict[str, int] = {"Conv": 1, "Gemm": -1, "MatMul": -1}
WEIGHT_INPUT, BIAS_INPUT = 1, 2
CHUNK = 1 << 16  # elements per block of the cosine sums (fits in a core's L2 cache with its buffers)
ASCENT_STEPS = 30  # at most; each accepted step raises the cosine, the search stops at the first that does not


@dataclass
class EasyQuantReport:
    """One searched layer. Cosines are over all samples at once; ``cosine_before`` is where the layer's
    search started (earlier layers already updated, so its input grid may have moved)."""

    layer: str              # node name
    tensor: str             # the compared output (after a fused Relu / Clip)
    cosine_before: float
    cosine_after: float
    act_factor: float       # new / original output scale (1.0: output not quantized)
    weight_factor: float    # mean over channels of new / original weight scale (1.0: weight not searched)


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
    """QuantizeLinear then DequantizeLinear as onnxruntime computes them (x / scale, round half to
    even); clipping to [qmin - zp, qmax - zp] before adding the zero point back is the same grid."""
    qmin, qmax = _qrange(zp.dtype)
    s = _broadcast(np.asarray(scale, x.dtype), axis, x.ndim)
    z = _broadcast(np.asarray(zp, x.dtype), axis, x.ndim)
    q = x / s
    np.rint(q, out=q)
    np.clip(q, qmin - z, qmax - z, out=q)
    q *= s
    return q


def _quantize_weight(w: np.ndarray, scale: np.ndarray, axis: int | None, dtype: np.dtype,
                     zp: np.ndarray) -> np.ndarray:
    qmin, qmax = _qrange(dtype)
    q = np.rint(w / _broadcast(scale, axis, w.ndim)) + _broadcast(zp.astype(np.float32), axis, w.ndim)
    return np.clip(q, qmin, qmax).astype(dtype)


Quant = tuple[float, float, float]  # (scale, qmin - zero point, qmax - zero point) of a per-tensor Q/DQ


def _block_sums(y: np.ndarray, r: np.ndarray, ch_axis: int | None, n_ch: int,
                quants: Sequence[Quant | None]) -> tuple[np.ndarray, np.ndarray]:
    """For each candidate Q/DQ (None: none) and output channel: sum of Q/DQ(y) * r and of Q/DQ(y)^2,
    float64, shape (candidates, channels); ``ch_axis`` None: one total.

    Block by block, all candidates on a block before the next: y and r are read from memory once and
    the candidates' quantization and dot products run in cache (large activations are memory bound).
    Float32 dot products within a block row, float64 across.
    """
    ndim = y.ndim
    if ch_axis is None:
        mode, cols = "total", y.size
    elif ch_axis % ndim == ndim - 1:
        mode, cols = "cols", n_ch                                # channels last: column sums
    else:
        mode, cols = "rows", int(np.prod(y.shape[ch_axis % ndim + 1:]))  # a row per (leading index, channel)
    if mode == "total":
        y2, r2, step = y.reshape(1, -1), r.reshape(1, -1), CHUNK
    else:
        y2, r2, step = y.reshape(-1, cols), r.reshape(-1, cols), max(1, CHUNK // cols)
    dot, qq = np.zeros((len(quants), n_ch)), np.zeros((len(quants), n_ch))
    n_blocks = -(-y2.shape[1] // step) if mode == "total" else -(-len(y2) // step)
    for i in range(n_blocks):
        if mode == "total":
            yb, rb = y2[0, i * step:(i + 1) * step], r2[0, i * step:(i + 1) * step]
        else:
            yb, rb = y2[i * step:(i + 1) * step], r2[i * step:(i + 1) * step]
        channel = np.arange(i * step, i * step + len(yb)) % n_ch if mode == "rows" else None
        # with many candidates, knowing the block's range saves the clip where nothing reaches it
        lo_y, hi_y = (float(yb.min()), float(yb.max())) if len(quants) > 2 and yb.size else (-np.inf, np.inf)
        buf = np.empty_like(yb)
        for k, quant in enumerate(quants):
            qb = yb
            if quant is not None:
                qb = np.divide(yb, np.float32(quant[0]), out=buf)
                np.rint(qb, out=qb)
                if lo_y / quant[0] < quant[1] or hi_y / quant[0] > quant[2]:  # only blocks that reach the clip
                    np.clip(qb, np.float32(quant[1]), np.float32(quant[2]), out=qb)
            if mode == "total":
                dot[k, 0] += float(np.dot(qb, rb))
                qq[k, 0] += float(np.dot(qb, qb))
            elif mode == "cols":
                dot[k] += np.einsum("ij,ij->j", qb, rb)
                qq[k] += np.einsum("ij,ij->j", qb, qb)
            else:
                dot[k] += np.bincount(channel, _row_dots(qb, rb), n_ch)
                qq[k] += np.bincount(channel, _row_dots(qb, qb), n_ch)
    scale = np.array([q[0] if q is not None else 1.0 for q in quants])[:, None]
    return dot * scale, qq * scale**2


def _row_dots(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Dot product of each row (float32); batched BLAS for long rows, einsum for short ones."""
    if a.shape[1] < 256:
        return np.einsum("ij,ij->i", a, b)
    return np.matmul(a[:, None, :], b[:, :, None])[:, 0, 0]


def _bias_fits(b: np.ndarray, in_scale: np.ndarray, w_scale: np.ndarray) -> np.ndarray:
    """Per channel: is the bias representable in int32 on the grid input scale x weight scale?"""
    step = np.maximum(np.float64(in_scale) * np.asarray(w_scale, np.float64), MIN_SCALE)
    return np.abs(b.astype(np.float64)).reshape(-1) / step.reshape(-1) <= np.iinfo(np.int32).max


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
        if out_dq is not None and g.inits.get(out_dq.input[1]).size != 1:
            out_dq = None  # a per-channel output grid: compared before it, its scale left alone
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
        runs = [sess.run(names, s) for s in samples]
        same = all(r[i].shape == runs[0][i].shape for r in runs for i in range(len(names)))
        self.values: dict[str, list[np.ndarray]] = {}
        for i, n in enumerate(names):
            per_sample = [r[i] for r in runs]
            for r in runs:
                r[i] = None  # freed as soon as concatenated
            self.values[n] = [np.concatenate(per_sample)] if same else per_sample

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
        opts = reference_session_options()
        # between runs numpy works on the outputs: idle onnxruntime threads should not spin on a core
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])

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

    def __init__(self, layer: _Layer, g: _Graph, values: _FloatValues, runner: _Runner, changed: set[str],
                 bias_users: dict[str, list[_Layer]]) -> None:
        self.layer, self.g, self.inits, self.runner, self.changed = layer, g, g.inits, runner, changed
        self.bias_users = bias_users  # input scale name -> layers whose bias lives on its grid
        self.acts = [{k: _fake_quant(v, self.inits.get(q.scale), self.inits.get(q.zero_point), q.axis)
                      if q is not None else v for k, (f, q) in layer.inputs.items()
                      for v in [values.values[f][b]]} for b in range(len(values.values[layer.out]))]
        self.ref = values.values[layer.out]
        self.current: list[np.ndarray] | None = None
        n_ch = self.inits.get(layer.weight.qdq.scale).size if layer.weight is not None else 1
        out_ch = self.ref[0].shape[LAYER_OPS[layer.node.op_type]] if self.ref[0].ndim else 0
        self.ch_axis = LAYER_OPS[layer.node.op_type] if n_ch > 1 and n_ch == out_ch else None
        self.n_ch = n_ch if self.ch_axis is not None else 1
        self.ff = sum(float(_block_sums(r, r, None, 1, [None])[0].sum()) for r in self.ref)

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
        """Layer outputs (before the output Q/DQ) for a weight scale; None: the current one (cached)."""
        if w_scale is None and self.current is not None:
            return self.current
        w, b = self.weight_bias(w_scale)
        ys = [self.runner(acts, w, b) for acts in self.acts]
        if w_scale is None:
            self.current = ys
        return ys

    def quant(self, scale: np.ndarray | None = None) -> Quant | None:
        """The output Q/DQ with ``scale`` (None: the current one)."""
        q = self.layer.out_qdq
        if q is None:
            return None
        zp = self.inits.get(q.zero_point)
        qmin, qmax = _qrange(zp.dtype)
        return float(self.inits.get(q.scale) if scale is None else scale), qmin - float(zp), qmax - float(zp)

    def stats(self, ys: list[np.ndarray], quants: Sequence[Quant | None], *,
              per_channel: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Per candidate Q/DQ (and channel): dot products with the float output, energies of the output."""
        ch_axis, n_ch = (self.ch_axis, self.n_ch) if per_channel else (None, 1)
        dot, qq = np.zeros((len(quants), n_ch)), np.zeros((len(quants), n_ch))
        for y, r in zip(ys, self.ref, strict=True):
            d, e = _block_sums(y, r, ch_axis, n_ch, quants)
            dot += d
            qq += e
        return dot, qq

    def act_step(self, factors: np.ndarray) -> tuple[float, float]:
        """Best output scale among factors x current; returns (cosine before, after)."""
        q = self.layer.out_qdq
        s0 = self.inits.get(q.scale)
        ys = self.outputs()
        cands = [np.maximum(s0 * np.float32(f), MIN_SCALE).astype(np.float32) for f in factors]
        group = self.sharing(q)
        users = [u for member in group for u in self.bias_users.get(member.scale, [])]
        valid = [k == 0 or all(_bias_fits(u.bias.value, s, self.inits.get(u.w_scale)).all() for u in users)
                 for k, s in enumerate(cands)]
        dot, qq = self.stats(ys, [self.quant(s) for s in cands], per_channel=False)
        cos = [_cosine(d.sum(), e.sum(), self.ff) if ok else -np.inf for d, e, ok in zip(dot, qq, valid, strict=True)]
        best = int(np.argmax(cos))  # the first max: ties keep the current scale
        if best:
            for member in group:
                self.inits.set(member.scale, cands[best])
                self.changed.add(member.scale)
        return cos[0], cos[best]

    def sharing(self, q: _QDQ) -> list[_QDQ]:
        """``q`` and the outputs of passive ops that share its grid (equal scale and zero point)."""
        scale, zp = self.inits.get(q.scale), self.inits.get(q.zero_point)
        group = [q]
        for reader in self.g.readers.get(q.output, []):
            if not getattr(QUANT_OPS.get(reader.op_type), "passive", False):
                continue
            for o in reader.output:
                dq = self.g.output_qdq(o)
                follower = self.g.qdq(dq) if dq is not None else None
                if (follower is not None and np.array_equal(self.inits.get(follower.scale), scale)
                        and np.array_equal(self.inits.get(follower.zero_point), zp)):
                    group += self.sharing(follower)
        return group

    def weight_step(self, factors: np.ndarray) -> tuple[float, float]:
        """Per-channel weight scales (factors x current), coordinate-wise on the exact cosine."""
        s0 = self.inits.get(self.layer.weight.qdq.scale)
        cands = [np.maximum(s0 * np.float32(f), MIN_SCALE).astype(np.float32) for f in factors]
        stats = [self.stats(self.outputs(s if k else None), [self.quant()]) for k, s in enumerate(cands)]
        dot = np.concatenate([d for d, _ in stats])   # (candidates, channels)
        qq = np.concatenate([e for _, e in stats])
        if self.layer.bias is not None:  # a bias beyond int32 on a candidate's grid rules it out
            in_scale = self.inits.get(self.layer.inputs[0][1].scale)
            for k, c in enumerate(cands[1:], 1):
                fits = _bias_fits(self.layer.bias.value, in_scale, c)
                dot[k, ~(fits if self.ch_axis is not None else fits.all(keepdims=True))] = -np.inf
        cols = np.arange(dot.shape[1])

        def objective(choice: np.ndarray) -> float:
            return _cosine(dot[choice, cols].sum(), qq[choice, cols].sum(), self.ff)

        shared = [objective(np.full(len(cols), k)) for k in range(len(cands))]
        choice = np.full(len(cols), int(np.argmax(shared)))
        best = objective(choice)
        for _ in range(ASCENT_STEPS):
            # Stationarity of D / sqrt(Q): each channel maximises dot - D / (2Q) * energy.
            d, e = dot[choice, cols].sum(), qq[choice, cols].sum()
            if e <= 0:
                break
            proposal = np.argmax(dot - d / (2 * e) * qq, axis=0)
            value = objective(proposal)
            if value <= best:
                break
            choice, best = proposal, value
        new = np.stack(cands)[choice, cols] if self.ch_axis is not None else cands[int(choice[0])]
        if not np.array_equal(new, s0):
            self.set_weight_scale(new)
        return shared[0], best

    def set_weight_scale(self, scale: np.ndarray) -> None:
        c = self.layer.weight
        zp = self.inits.get(c.qdq.zero_point)
        self.current = None
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
    bias_users: dict[str, list[_Layer]] = {}
    for layer in layers:
        if layer.bias is not None:
            bias_users.setdefault(layer.inputs[0][1].scale, []).append(layer)
    changed: set[str] = set()
    reports = []
    for idx, layer in enumerate(layers):
        runner = _Runner(layer, qmodel, inits)
        reports.append(_Search(layer, g, values, runner, changed, bias_users).run(factors, rounds))
        values.release([n for n, i in last_use.items() if i == idx])
        r = reports[-1]
        log.debug("easy_quant %s: cosine %.6f -> %.6f (act x%.3f, weight x%.3f)", r.layer, r.cosine_before,
                  r.cosine_after, r.act_factor, r.weight_factor)
    if reports:
        log.info("easy_quant: %d layers, mean cosine %.6f -> %.6f in %.1f s", len(reports),
                 np.mean([r.cosine_before for r in reports]), np.mean([r.cosine_after for r in reports]),
                 time.perf_counter() - start)
    return qmodel, reports


def update_params(params: dict[str, TensorQuant], qmodel: onnx.ModelProto) -> list[str]:
    """Copy the scales ``easy_quant`` wrote into ``qmodel`` back into the per-tensor parameters that
    quant_config.json is written from (zero points never change); returns the names updated."""
    inits = {t.name: t for t in qmodel.graph.initializer}
    updated = []
    for name, tq in params.items():
        t = inits.get(f"{name}/scale")
        if t is None:
            continue
        scale = numpy_helper.to_array(t).astype(np.float32).reshape(np.shape(tq.scale))
        if not np.array_equal(scale, tq.scale):
            tq.scale = scale
            updated.append(name)
    return updated
