"""Per-layer view of a QDQ model, shared by the algorithms that retune one quantized Conv / Gemm /
MatMul at a time: EasyQuant's scale search (:mod:`easy_quant`) today, per-layer fine-tuning
(AdaRound, BRECQ, LSQ) next. They all need the layers and their Q/DQ parameters, initializers
writable in place, the float model's values, a one-layer onnxruntime model and Q/DQ arithmetic in
numpy, so these live here and each algorithm module keeps only its own search.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from pulsar.core.ort_options import reference_session_options
from pulsar.core.plugin_session import inference_session
from pulsar.errors import PulsarError, did_you_mean
from pulsar.quant.ops import FUSED_ACTIVATIONS
from pulsar.quant.scheme import MIN_SCALE

# Searched op types -> the output axis that holds the weight's per-channel axis (output channels).
LAYER_OPS: dict[str, int] = {"Conv": 1, "Gemm": -1, "MatMul": -1}
WEIGHT_INPUT, BIAS_INPUT = 1, 2
CHUNK = 1 << 16  # elements per block of the cosine sums (fits in a core's L2 cache with its buffers)


@dataclass
class QDQ:
    """One DequantizeLinear's parameters: initializer names (the values live in the model)."""

    scale: str
    zero_point: str
    axis: int | None
    output: str          # the dequantized tensor in the QDQ model


@dataclass
class Const:
    """A quantized constant (weight or bias) of a layer."""

    name: str           # the DequantizeLinear output (= the float model's initializer)
    q: str              # its integer initializer
    qdq: QDQ
    value: np.ndarray   # float value from the float model


@dataclass
class Layer:
    node: onnx.NodeProto
    act: onnx.NodeProto | None                # fused Relu / Clip between the op and its output Q/DQ
    inputs: dict[int, tuple[str, QDQ | None]]  # activation input index -> (float name, its Q/DQ)
    weight: Const | None                      # searched weight (None: left as exported)
    bias: Const | None                        # bias kept on the input scale x weight scale grid
    w_scale: str | None                       # the weight's scale initializer (searched or not)
    out: str                                  # compared tensor (float model name)
    out_qdq: QDQ | None


class Inits:
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


def qrange(dtype: np.dtype) -> tuple[int, int]:
    info = np.iinfo(dtype)
    return int(info.min), int(info.max)


def broadcast(scale: np.ndarray, axis: int | None, ndim: int) -> np.ndarray:
    if axis is None or scale.ndim == 0:
        return scale
    shape = [1] * ndim
    shape[axis % ndim] = -1
    return scale.reshape(shape)


def fake_quant(x: np.ndarray, scale: np.ndarray, zp: np.ndarray, axis: int | None) -> np.ndarray:
    """QuantizeLinear then DequantizeLinear as onnxruntime computes them (x / scale, round half to
    even); clipping to [qmin - zp, qmax - zp] before adding the zero point back is the same grid."""
    qmin, qmax = qrange(zp.dtype)
    s = broadcast(np.asarray(scale, x.dtype), axis, x.ndim)
    z = broadcast(np.asarray(zp, x.dtype), axis, x.ndim)
    q = x / s
    np.rint(q, out=q)
    np.clip(q, qmin - z, qmax - z, out=q)
    q *= s
    return q


def quantize_weight(w: np.ndarray, scale: np.ndarray, axis: int | None, dtype: np.dtype,
                    zp: np.ndarray) -> np.ndarray:
    qmin, qmax = qrange(dtype)
    q = np.rint(w / broadcast(scale, axis, w.ndim)) + broadcast(zp.astype(np.float32), axis, w.ndim)
    return np.clip(q, qmin, qmax).astype(dtype)


Quant = tuple[float, float, float]  # (scale, qmin - zero point, qmax - zero point) of a per-tensor Q/DQ


def block_sums(y: np.ndarray, r: np.ndarray, ch_axis: int | None, n_ch: int,
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


def bias_fits(b: np.ndarray, in_scale: np.ndarray, w_scale: np.ndarray) -> np.ndarray:
    """Per channel: is the bias representable in int32 on the grid input scale x weight scale?"""
    step = np.maximum(np.float64(in_scale) * np.asarray(w_scale, np.float64), MIN_SCALE)
    return np.abs(b.astype(np.float64)).reshape(-1) / step.reshape(-1) <= np.iinfo(np.int32).max


def cosine(dot: float, qq: float, ff: float) -> float:
    return float(dot / np.sqrt(qq * ff)) if qq > 0 and ff > 0 else 0.0


class Graph:
    """Who produces / reads what in the QDQ model, and the float model's tensor names."""

    def __init__(self, float_model: onnx.ModelProto, qmodel: onnx.ModelProto, inits: Inits,
                 caller: str) -> None:
        self.inits, self.caller = inits, caller  # caller: the algorithm named in user errors
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
        raise PulsarError(f'{self.caller}: QDQ model tensor "{name}" has no counterpart in the float model'
                          f"{did_you_mean(name, self.float_names)}; pass the float model the QDQ model was "
                          "exported from")

    def dq_of(self, name: str) -> onnx.NodeProto | None:
        n = self.producer.get(name)
        return n if n is not None and n.op_type == "DequantizeLinear" and len(n.input) == 3 else None

    @staticmethod
    def qdq(dq: onnx.NodeProto) -> QDQ:
        axis = next((a.i for a in dq.attribute if a.name == "axis"), None)
        return QDQ(dq.input[1], dq.input[2], int(axis) if axis is not None else None, dq.output[0])

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

    def const(self, name: str) -> Const | None:
        dq = self.dq_of(name)
        if dq is None or dq.input[0] not in self.inits or name not in self.float_inits:
            return None
        return Const(name, dq.input[0], self.qdq(dq), numpy_helper.to_array(self.float_inits[name]))


def find_layers(g: Graph, qmodel: onnx.ModelProto) -> list[Layer]:
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
        consts: dict[int, Const | None] = {}
        inputs: dict[int, tuple[str, QDQ | None]] = {}
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
        layers.append(Layer(node, act, inputs, weight, bias, w_dq.input[1] if w_dq is not None else None,
                            g.float_name(out_dq.output[0] if out_dq else last),
                            g.qdq(out_dq) if out_dq is not None else None))
    return layers


class FloatValues:
    """Float-model values of the tensors the layers read and compare, for all samples, one run each.
    Samples with equal shapes are concatenated along axis 0 (the batch / row axis of every searched op)."""

    def __init__(self, float_model: onnx.ModelProto, samples: Sequence[dict[str, np.ndarray]],
                 names: list[str]) -> None:
        m = onnx.ModelProto()
        m.CopyFrom(float_model)
        known = {o.name for o in m.graph.output}
        m.graph.output.extend(helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None)
                              for n in names if n not in known)
        sess = inference_session(m.SerializeToString(), providers=["CPUExecutionProvider"])
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


class Runner:
    """The layer (and its fused activation) as a tiny onnxruntime model: activation inputs, weight and
    bias are fed, other constants copied."""

    def __init__(self, layer: Layer, qmodel: onnx.ModelProto, inits: Inits) -> None:
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
            nodes, "qdq_layer",
            [helper.make_tensor_value_info(f, onnx.TensorProto.FLOAT, None) for f in self.feed_names.values()],
            [helper.make_tensor_value_info(self.output, onnx.TensorProto.FLOAT, None)], initializer=consts)
        model = helper.make_model(graph, opset_imports=[o for o in qmodel.opset_import if o.domain in ("", "ai.onnx")])
        model.ir_version = qmodel.ir_version
        opts = reference_session_options()
        # between runs numpy works on the outputs: idle onnxruntime threads should not spin on a core
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.sess = inference_session(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])

    @staticmethod
    def _dq_value(qmodel: onnx.ModelProto, inits: Inits, name: str) -> np.ndarray:
        dq = next(n for n in qmodel.graph.node if name in n.output)
        axis = next((a.i for a in dq.attribute if a.name == "axis"), None)
        q, s, z = (inits.get(i) for i in dq.input)
        return ((q.astype(np.float64) - broadcast(z, axis, q.ndim)) * broadcast(s, axis, q.ndim)).astype(np.float32)

    def __call__(self, acts: dict[int, np.ndarray], w: np.ndarray | None, b: np.ndarray | None) -> np.ndarray:
        feeds = {self.feed_names[k]: v for k, v in acts.items()}
        if w is not None:
            feeds[self.feed_names[WEIGHT_INPUT]] = w
        if b is not None:
            feeds[self.feed_names[BIAS_INPUT]] = b
        return self.sess.run([self.output], feeds)[0]
