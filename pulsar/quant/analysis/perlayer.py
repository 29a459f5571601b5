"""Quantization precision per layer: compare every float-model tensor with its QDQ-model value.

For each node of the float model (graph order) and its first output ``T`` (when floating point),
the float model's ``T`` is compared with the QDQ model's ``T`` (the dequantized value when ``T`` is
quantized) over a stream of samples (see :mod:`pulsar.quant.analysis.metrics`). Two methods:

``EndToEnd``
    The whole QDQ model runs on the sample, so errors accumulate through the network: the row of
    a layer shows how far its value has drifted from float at that point of the network.

``PerLayer``
    Every layer is fed the float model's values, so a row shows only the error that layer adds by
    itself (its weight quantization, the quantization of its inputs and of its own output). Both
    models are merged into ONE onnxruntime graph, run once per sample:

    1. a copy of the float graph with every name prefixed ``__float__/`` (graph inputs keep their
       names, so both halves read the same feeds);
    2. the QDQ graph, rewired: every edge that carries an op's own result (the QDQ op producing
       ``T/float``, or ``T`` itself where ``T`` is not quantized, matched to the float node that
       produces ``T``) now reads the float copy's ``__float__/T`` instead. The QuantizeLinear of a
       quantized tensor therefore quantizes the float value, and each op reads
       ``DQ(Q(float value))`` where the QDQ model quantizes that input and the plain float value
       where it does not. Weight / bias / constant DequantizeLinear nodes stay as they are;
    3. the op's own output is what is measured: for a quantized ``T`` it passes through a copy
       of ``T``'s own Q/DQ pair (same scale and zero point) into ``__perlayer__/T``, otherwise the
       op's output is taken as is.

    A Conv whose Relu is fused (the Conv output is not quantized) thus gets a row with the Conv's
    own error, and the Relu's row shows the output quantization added on top of exact inputs.

EndToEnd uses the same merged graph without the rewiring, so both methods cost one session.
Reference execution: onnxruntime with :func:`pulsar.core.ort_options.reference_session_options`
(QDQ fusion off, so Q/DQ run as float math).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from pulsar.core.ort_options import reference_session_options
from pulsar.core.plugin_session import inference_session
from pulsar.errors import PulsarError, did_you_mean
from pulsar.quant.analysis.metrics import COSINE_OK, Accumulator, SliceScore

log = logging.getLogger(__name__)

FLOAT_PREFIX = "__float__/"
PERLAYER_PREFIX = "__perlayer__/"

FLOAT_DTYPES = {TensorProto.FLOAT: "FP32", TensorProto.FLOAT16: "FP16", TensorProto.BFLOAT16: "BF16",
                TensorProto.DOUBLE: "FP64"}
QDTYPES = {np.dtype(np.uint8): "U8", np.dtype(np.int8): "S8", np.dtype(np.uint16): "U16",
           np.dtype(np.int16): "S16", np.dtype(np.int32): "S32"}


@dataclass
class LayerPrecision:
    node: str          # float model node name
    op_type: str
    tensor: str        # its first output
    shape: tuple       # shape of that tensor (first sample)
    dtype: str         # float model dtype, e.g. "FP32"
    qdtype: str        # "U8" / "S8" / ... or the float dtype when the QDQ model keeps it float
    cosine: float
    mse: float
    sqnr_db: float
    worst_slice: SliceScore | None = None  # the slice (channel / last-axis index) with the lowest cosine

    @property
    def slice_cosine(self) -> float:
        """The worst slice's cosine (the tensor's when it has no slices)."""
        return self.worst_slice.cosine if self.worst_slice is not None else self.cosine

    def fix(self) -> str:
        """The layer_configs entry that would keep this row's worst slice, when that slice is poor."""
        if self.slice_cosine >= COSINE_OK or self.qdtype in FLOAT_DTYPES.values():
            return ""
        dtype = "U16" if self.qdtype in ("U8", "S8") else "FP32"
        return f'{{"layer_name": "{self.node}", "data_type": "{dtype}"}}'


def layer_name(node: onnx.NodeProto, index: int) -> str:
    """The name a row uses for a node (nameless nodes get ``<op_type>_<index>``)."""
    return node.name or f"{node.op_type}_{index}"


@dataclass
class _Probe:
    """One row: which tensor of the merged graph is the float value and which the quantized one."""

    node: str
    op_type: str
    tensor: str
    dtype: str
    elem_type: int
    float_out: str
    qdq_out: str


@dataclass
class _Ctx:
    float_model: onnx.ModelProto
    qgraph: onnx.GraphProto                 # the QDQ graph copy builders may rewire
    layers: list[tuple[str, onnx.NodeProto, str, int]]  # (row name, float node, T, elem type)
    producers: dict[str, onnx.NodeProto]    # QDQ graph, before any rewiring
    consumers: dict[str, list[onnx.NodeProto]]
    extra_nodes: list[onnx.NodeProto] = field(default_factory=list)


def _probe(name: str, node: onnx.NodeProto, tensor: str, elem: int, qdq_out: str) -> _Probe:
    return _Probe(name, node.op_type, tensor, FLOAT_DTYPES[elem], elem, FLOAT_PREFIX + tensor, qdq_out)


METHODS: dict[str, Callable[[_Ctx], list[_Probe]]] = {}


def register_method(name: str):
    def deco(fn: Callable[[_Ctx], list[_Probe]]) -> Callable[[_Ctx], list[_Probe]]:
        METHODS[name] = fn
        return fn

    return deco


@register_method("EndToEnd")
def _end_to_end(ctx: _Ctx) -> list[_Probe]:
    return [_probe(name, n, t, elem, t) for name, n, t, elem in ctx.layers if t in ctx.producers]


@register_method("PerLayer")
def _per_layer(ctx: _Ctx) -> list[_Probe]:
    # QDQ-graph names of the ops' own results -> the float tensor they correspond to.
    own: dict[str, str] = {}
    for n in ctx.float_model.graph.node:
        for out in n.output:
            for cand in (f"{out}/float", out):
                p = ctx.producers.get(cand)
                if out and p is not None and p.op_type == n.op_type:
                    own[cand] = out
                    break
    for n in ctx.qgraph.node:
        for i, name in enumerate(n.input):
            if name in own:
                n.input[i] = FLOAT_PREFIX + own[name]
    probes = []
    for name, n, t, elem in ctx.layers:
        src = next((c for c in (f"{t}/float", t) if own.get(c) == t), None)
        if src is None:
            log.debug("precision: %s has no matching op in the QDQ model; skipped", name)
            continue
        measured = src
        qn = next((c for c in ctx.consumers.get(src, []) if c.op_type == "QuantizeLinear"), None)
        dq = next((c for c in ctx.consumers.get(qn.output[0], []) if c.op_type == "DequantizeLinear"), None) \
            if qn is not None else None
        if qn is not None and dq is not None:
            measured = PERLAYER_PREFIX + t
            q2, dq2 = onnx.NodeProto(), onnx.NodeProto()
            q2.CopyFrom(qn)
            dq2.CopyFrom(dq)
            q2.input[0], q2.output[0], q2.name = src, f"{measured}/q", f"{PERLAYER_PREFIX}{qn.name}"
            dq2.input[0], dq2.output[0], dq2.name = q2.output[0], measured, f"{PERLAYER_PREFIX}{dq.name}"
            ctx.extra_nodes += [q2, dq2]
        probes.append(_probe(name, n, t, elem, measured))
    return probes


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    try:
        model = onnx.shape_inference.infer_shapes(model)
    except Exception as exc:  # noqa: BLE001 - inference is best effort; declared types are used then
        log.debug("precision: shape inference failed (%s); using declared types", exc)
    g = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.output, *g.value_info]}
    types.update({t.name: t.data_type for t in g.initializer})
    return types


def _float_copy(float_model: onnx.ModelProto) -> onnx.GraphProto:
    """The float graph with every name prefixed; graph inputs keep theirs (shared feeds)."""
    g = onnx.GraphProto()
    g.CopyFrom(float_model.graph)
    inits = {t.name for t in g.initializer}
    inputs = [i for i in g.input if i.name not in inits]
    names = {i.name for i in inputs}
    value_info = [v for v in g.value_info if v.name not in names]
    del g.input[:], g.value_info[:]
    g.input.extend(inputs)
    g.value_info.extend(value_info)
    return onnx.compose.add_prefix_graph(g, FLOAT_PREFIX, rename_inputs=False, inplace=True)


def _data_inputs(g: onnx.GraphProto) -> list[onnx.ValueInfoProto]:
    inits = {t.name for t in g.initializer}
    return [i for i in g.input if i.name not in inits]


def _merged_model(float_model: onnx.ModelProto, qdq_model: onnx.ModelProto,
                  method: str) -> tuple[onnx.ModelProto, list[_Probe]]:
    f_inputs = [i.name for i in _data_inputs(float_model.graph)]
    q_inputs = [i.name for i in _data_inputs(qdq_model.graph)]
    if sorted(f_inputs) != sorted(q_inputs):
        raise PulsarError(f"precision analysis: the QDQ model's inputs {q_inputs} differ from the float model's "
                          f"{f_inputs}; pass the QDQ model built from this float model")
    types = _elem_types(float_model)
    layers = []
    for idx, n in enumerate(float_model.graph.node):
        t = n.output[0] if n.output else ""
        if t and types.get(t) in FLOAT_DTYPES:
            layers.append((layer_name(n, idx), n, t, types[t]))
    qgraph = onnx.GraphProto()
    qgraph.CopyFrom(qdq_model.graph)
    producers = {o: n for n in qgraph.node for o in n.output if o}
    consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for n in qgraph.node:
        for i in n.input:
            consumers[i].append(n)
    ctx = _Ctx(float_model, qgraph, layers, producers, consumers)
    probes = METHODS[method](ctx)

    fgraph = _float_copy(float_model)
    outputs, seen = [], set()
    for p in probes:
        for name in (p.float_out, p.qdq_out):
            if name not in seen:
                seen.add(name)
                outputs.append(helper.make_tensor_value_info(name, p.elem_type, None))
    graph = helper.make_graph([*fgraph.node, *qgraph.node, *ctx.extra_nodes], f"{qgraph.name}_precision",
                              _data_inputs(qgraph), outputs, initializer=[*qgraph.initializer, *fgraph.initializer],
                              value_info=[*fgraph.value_info, *qgraph.value_info])
    graph.sparse_initializer.extend([*qgraph.sparse_initializer, *fgraph.sparse_initializer])
    model = helper.make_model(graph, opset_imports=list(qdq_model.opset_import))
    model.ir_version = qdq_model.ir_version
    model.functions.extend(qdq_model.functions)
    return model, probes


def _feeds(sample: Any, names: list[str], k: int) -> dict[str, np.ndarray]:
    if not isinstance(sample, Mapping):
        raise PulsarError(f"precision analysis: sample {k} is a {type(sample).__name__}; each sample must be a "
                          f"dict of input name -> array for the inputs {names}")
    for n in sample:
        if n not in names:
            raise PulsarError(f'precision analysis: sample {k} has unknown input "{n}"{did_you_mean(n, names)}; '
                              f"model inputs: {names}")
    missing = [n for n in names if n not in sample]
    if missing:
        raise PulsarError(f"precision analysis: sample {k} lacks input(s) {missing}; model inputs: {names}")
    return {n: np.asarray(sample[n]) for n in names}


def analyze(float_model: onnx.ModelProto, qdq_model: onnx.ModelProto, samples: Iterable[dict[str, np.ndarray]],
            *, method: str = "PerLayer", quant_json: dict | None = None,
            progress: Callable[[int], None] | None = None) -> list[LayerPrecision]:
    """Precision of every float-model layer's first output in the QDQ model, averaged over ``samples``.

    ``samples`` is consumed once, one sample at a time; ``progress(n)`` is called after the n-th. ``quant_json`` (the parsed
    quant/quant_config.json) supplies the QDType column; without it the dtype is read from the
    QDQ model's DequantizeLinear zero points.
    """
    if method not in METHODS:
        raise PulsarError(f"precision analysis: unknown method {method!r}{did_you_mean(method, METHODS)}; "
                          f"choose one of {sorted(METHODS)}")
    t0 = time.perf_counter()
    model, probes = _merged_model(float_model, qdq_model, method)
    sess = inference_session(model.SerializeToString(), reference_session_options(),
                                providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    out_names = [o.name for o in sess.get_outputs()]
    accs = [Accumulator() for _ in probes]
    shapes: list[tuple | None] = [None] * len(probes)
    count = 0
    for k, sample in enumerate(samples):
        feeds = _feeds(sample, names, k)
        try:
            values = dict(zip(out_names, sess.run(out_names, feeds), strict=True))
        except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own exception types
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise PulsarError(f"precision analysis: sample {k} cannot be run ({first}); check its shapes and "
                              f"dtypes against the model inputs") from None
        for i, p in enumerate(probes):
            a = values[p.float_out]
            if shapes[i] is None:
                shapes[i] = tuple(int(d) for d in a.shape)
            accs[i].add(a, values[p.qdq_out])
        count += 1
        if progress is not None:
            progress(count)
    if not count:
        raise PulsarError("precision analysis: no samples were given; pass at least one input sample")
    tensors = (quant_json or {}).get("tensors", {})
    inits = {t.name: t for t in qdq_model.graph.initializer}
    producers = {o: n for n in qdq_model.graph.node for o in n.output}
    rows = [LayerPrecision(p.node, p.op_type, p.tensor, shapes[i] or (), p.dtype,
                           _qdtype(p.tensor, tensors, producers, inits, p.dtype),
                           accs[i].cosine, accs[i].mse, accs[i].sqnr_db, accs[i].worst_slice)
            for i, p in enumerate(probes)]
    log.info("precision analysis (%s): %d layers over %d sample%s in %.2f s", method, len(rows), count,
             "" if count == 1 else "s", time.perf_counter() - t0)
    return rows


def _qdtype(tensor: str, tensors: dict, producers: dict[str, onnx.NodeProto],
            inits: dict[str, onnx.TensorProto], fallback: str) -> str:
    entry = tensors.get(tensor)
    if isinstance(entry, dict) and entry.get("dtype"):
        return str(entry["dtype"])
    p = producers.get(tensor)
    if p is None or p.op_type != "DequantizeLinear":
        return fallback
    zp = inits.get(p.input[2]) if len(p.input) > 2 and p.input[2] else None
    if zp is None:
        return "U8"  # QuantizeLinear's default output type
    return QDTYPES.get(np.dtype(helper.tensor_dtype_to_np_dtype(zp.data_type)), fallback)
