"""The quantized graph at another input shape or batch size, before it is lowered again.

Multi-batch and extra-shape compilation lower the *same* QDQ graph (the same quantization parameters)
with other input dims. Exported models often bake the batch into constants: a Reshape to
``[1, 120, -1]``, a class token ``[1, 1, C]`` concatenated to the tokens. Unless
``compiler.disable_ir_fix``, a batch other than 1 rewrites them:

- Reshape: a constant target whose dim 0 is the batch (1) while its data comes from the model's inputs
  gets dim 0 = -1 (or 0, "copy the input's dim 0", when another dim is already -1);
- Concat along another axis than 0 of a batch-carrying tensor and a constant with dim 0 = 1 (an
  initializer, possibly behind Q / DQ / Cast, or made by Expand / Tile / ConstantOfShape from a
  constant shape) gets the constant repeated to the batch.

The new graph is then checked: strict ONNX shape inference plus an element-count check of every
Reshape (which ONNX inference does not do); a node that cannot take the new dims is one error naming
it, with the fix (a ``const_processors`` patch, or leaving the shape out).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from pulsar.compiler.lower.qdq_graph import inferable
from pulsar.core.plugin_session import inference_session
from pulsar.core.tensors import initializer_array
from pulsar.errors import PulsarError

log = logging.getLogger(__name__)

_PASS_THROUGH = ("DequantizeLinear", "QuantizeLinear", "Cast", "Identity")
_SHAPE_MAKERS = {"Expand": 1, "Tile": 1, "ConstantOfShape": 0}  # op -> index of its shape / repeats input
_INFER_ERROR = re.compile(r"\(op_type:(?P<op>[^,]+), node name: (?P<node>[^)]*)\): (?P<msg>.*)", re.S)


def _carriers(graph: onnx.GraphProto) -> set[str]:
    """Tensors computed from the model's inputs (the ones that carry the batch)."""
    inits = {t.name for t in graph.initializer}
    live = {i.name for i in graph.input if i.name not in inits}
    for node in graph.node:
        if any(n in live for n in node.input if n):
            live.update(o for o in node.output if o)
    return live


class _Consts:
    """Initializers by name; rewritten copies get a new name so other readers keep the original."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.by_name = {t.name: t for t in graph.initializer}

    def get(self, name: str) -> np.ndarray | None:
        t = self.by_name.get(name)
        return None if t is None else initializer_array(t)

    def replace(self, node: onnx.NodeProto, index: int, value: np.ndarray, tag: str) -> str:
        base = f"{node.input[index]}/{tag}"
        name, k = base, 1
        while name in self.by_name:
            k += 1
            name = f"{base}{k}"
        tensor = numpy_helper.from_array(value, name)
        self.graph.initializer.append(tensor)
        self.by_name[name] = tensor
        node.input[index] = name
        return name


def _fix_reshapes(graph: onnx.GraphProto, consts: _Consts, carriers: set[str],
                  dim0: dict[str, int | None]) -> list[str]:
    fixes = []
    for node in graph.node:
        if node.op_type != "Reshape" or len(node.input) < 2 or node.input[0] not in carriers:
            continue
        target = consts.get(node.input[1])
        if target is None or target.ndim != 1 or not target.size or int(target[0]) != 1:
            continue
        new = target.copy()
        if -1 not in target[1:].tolist():
            new[0] = -1
        elif dim0.get(node.input[0]) == 1:
            new[0] = 0
        else:
            continue  # the batch is elsewhere: the shape check below names the node
        consts.replace(node, 1, new, "batch")
        fixes.append(f"Reshape {node.name!r}: shape {target.tolist()} -> {new.tolist()}")
    return fixes


def _constant_source(name: str, producers: dict[str, onnx.NodeProto], consts: _Consts
                     ) -> tuple[onnx.NodeProto | None, int] | None:
    """Where a constant operand's dim 0 is decided: (node, input index) of an Expand / Tile /
    ConstantOfShape shape, or (None, -1) for an initializer reached through Q / DQ / Cast / Identity."""
    seen = 0
    while seen < 16:
        seen += 1
        if consts.get(name) is not None:
            return None, -1
        node = producers.get(name)
        if node is None:
            return None
        if node.op_type in _SHAPE_MAKERS:
            return node, _SHAPE_MAKERS[node.op_type]
        if node.op_type not in _PASS_THROUGH:
            return None
        name = node.input[0]
    return None


def _fix_concats(graph: onnx.GraphProto, consts: _Consts, carriers: set[str], batch: int) -> list[str]:
    producers = {o: n for n in graph.node for o in n.output if o}
    fixes = []
    for node in list(graph.node):
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if node.op_type != "Concat" or axis == 0 or not any(n in carriers for n in node.input):
            continue
        for i, name in enumerate(node.input):
            if name in carriers:
                continue
            source = _constant_source(name, producers, consts)
            if source is None:
                continue
            maker, index = source
            if maker is None:  # an initializer (behind Q / DQ): repeat it; the chain reads the copy
                chain_node, chain_index, value_name = node, i, name
                while consts.get(value_name) is None:
                    chain_node, chain_index = producers[value_name], 0
                    value_name = chain_node.input[0]
                value = consts.get(value_name)
                assert value is not None
                if value.ndim == 0 or value.shape[0] != 1:
                    continue
                consts.replace(chain_node, chain_index, np.repeat(value, batch, axis=0), f"batch{batch}")
                fixes.append(f"Concat {node.name!r}: constant {value_name!r} repeated to batch {batch}")
                continue
            shape = consts.get(maker.input[index])
            if shape is None or shape.ndim != 1 or not shape.size or int(shape[0]) != 1:
                continue
            new = shape.copy()
            new[0] = batch
            consts.replace(maker, index, new, f"batch{batch}")
            fixes.append(f"{maker.op_type} {maker.name!r}: {shape.tolist()} -> {new.tolist()} (feeds Concat "
                         f"{node.name!r})")
    return fixes


def _dims(vi: onnx.ValueInfoProto) -> list[int] | None:
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return None
    dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
    return dims if all(d >= 0 for d in dims) else None


def _reshape_target(shape: list[int], target: list[int], allowzero: bool) -> list[int] | None:
    out = [shape[i] if t == 0 and not allowzero and i < len(shape) else t for i, t in enumerate(target)]
    known = int(np.prod([d for d in out if d != -1])) if out else 1
    total = int(np.prod(shape)) if shape else 1
    if -1 in out:
        if known == 0 or total % known:
            return None
        out[out.index(-1)] = total // known
    return out if int(np.prod(out) if out else 1) == total else None


def _check(model: onnx.ModelProto, what: str, hint: str) -> onnx.GraphProto:
    """Strict shape inference of the re-shaped graph plus the Reshape element counts."""
    try:
        inferred = onnx.shape_inference.infer_shapes(inferable(model), check_type=False, strict_mode=True,
                                                     data_prop=True)
    except onnx.shape_inference.InferenceError as exc:
        m = _INFER_ERROR.search(str(exc))
        if m is None:
            raise PulsarError(f"{what}: the graph cannot take these input dims ({str(exc).strip()}); {hint}") from None
        msg = m["msg"].strip().splitlines()[0].replace("[ShapeInferenceError] ", "")
        raise PulsarError(f"{what}: node {m['node']!r} ({m['op']}) cannot take these input dims ({msg}); "
                          f"{hint}") from None
    g = inferred.graph
    shapes = {v.name: _dims(v) for v in [*g.input, *g.value_info, *g.output]}
    inits = {t.name: initializer_array(t) for t in g.initializer}
    for node in g.node:
        if node.op_type != "Reshape" or node.input[1] not in inits or shapes.get(node.input[0]) is None:
            continue
        allowzero = any(a.name == "allowzero" and a.i for a in node.attribute)
        shape, target = shapes[node.input[0]], inits[node.input[1]].astype(np.int64).tolist()
        assert shape is not None
        if _reshape_target(shape, target, allowzero) is None:
            raise PulsarError(f"{what}: Reshape {node.name!r} cannot reshape {shape} to its constant shape {target} "
                              f"(input {node.input[1]!r}); {hint}")
    return g


_ORT_ERROR = re.compile(r"running (?P<op>\w+) node\. Name:'(?P<node>[^']*)' Status Message: (?P<msg>.*)", re.S)


def _run_once(model: onnx.ModelProto, what: str, hint: str) -> None:
    """Run the re-shaped graph once on zeros in onnxruntime: what shape inference does not check (a
    convolution's channels, a broadcast) fails here, naming the node."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # errors name the model's nodes
    options.log_severity_level = 3
    try:
        sess = inference_session(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        feeds = {i.name: np.zeros([d if isinstance(d, int) else 1 for d in i.shape],
                                  np.dtype(_ORT_TYPES.get(i.type, "float32"))) for i in sess.get_inputs()}
        sess.run(None, feeds)
    except Exception as exc:  # onnxruntime raises its own exception types
        text = str(exc)
        m = _ORT_ERROR.search(text)
        if m is None:
            first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
            raise PulsarError(f"{what}: the graph cannot run at these input dims ({first}); {hint}") from None
        msg = m["msg"].strip().splitlines()[0]
        raise PulsarError(f"{what}: node {m['node']!r} ({m['op']}) cannot take these input dims ({msg}); "
                          f"{hint}") from None


def _session(model: onnx.ModelProto) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    return inference_session(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _random(info: Any, shape: list[int], rng: np.random.Generator) -> np.ndarray:
    dtype = np.dtype(_ORT_TYPES.get(info.type, "float32"))
    if np.issubdtype(dtype, np.integer):
        limits = np.iinfo(dtype)
        return rng.integers(max(limits.min, -128), min(limits.max, 255) + 1, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def _same_as_single_samples(single: onnx.ModelProto, batched: onnx.ModelProto, batch: int, what: str,
                            fixes: list[str]) -> None:
    """The batch-``batch`` graph on random samples against the original graph run once per sample: a
    rewrite (or an op) that mixes samples changes most values, float rounding or a quantization step
    flipped at a boundary changes few."""
    try:
        one, many = _session(single), _session(batched)
    except Exception:  # already reported by _run_once when the batched graph cannot load
        return
    rng = np.random.default_rng(0)
    feeds = {i.name: _random(i, [batch, *[d if isinstance(d, int) else 1 for d in i.shape][1:]], rng)
             for i in many.get_inputs()}
    got = many.run(None, feeds)
    singles = [one.run(None, {k: v[s:s + 1] for k, v in feeds.items()}) for s in range(batch)]
    for k, out in enumerate(many.get_outputs()):
        want = np.concatenate([np.asarray(r[k]) for r in singles]).astype(np.float64)
        have = np.asarray(got[k]).astype(np.float64)
        if want.shape != have.shape:
            close = 0.0
        else:
            scale = max(float(np.abs(want).max(initial=0.0)), 1e-12)
            close = float(np.mean(np.abs(have - want) <= 0.02 * scale))
        if close < 0.99:
            rewrites = f" after the IR fix ({'; '.join(fixes)})" if fixes else ""
            raise PulsarError(f"{what}: output {out.name!r} of the batched graph differs from single-sample runs"
                              f"{rewrites}: the graph mixes the samples of a batch (e.g. a Reshape whose batch "
                              "is not on axis 0); patch its constants with const_processors, or compile without "
                              "multi-batch")


_ORT_TYPES = {"tensor(float)": "float32", "tensor(uint8)": "uint8", "tensor(int8)": "int8",
              "tensor(uint16)": "uint16", "tensor(int16)": "int16", "tensor(int32)": "int32",
              "tensor(int64)": "int64", "tensor(float16)": "float16", "tensor(double)": "float64",
              "tensor(bool)": "bool"}


def reshaped(qmodel: onnx.ModelProto, shapes: dict[str, list[int]], *, batch: int, ir_fix: bool,
             what: str) -> tuple[onnx.ModelProto, list[str]]:
    """``qmodel`` with its inputs set to ``shapes`` (dim 0 = ``batch`` when ``batch`` > 1), the batch
    constants rewritten (``ir_fix``), checked. Returns the model and one line per rewrite."""
    model = onnx.ModelProto()
    model.CopyFrom(qmodel)
    g = model.graph
    before = {v.name: _dims(v) for v in [*g.input, *g.value_info, *g.output]}
    dim0 = {name: (dims[0] if dims else None) for name, dims in before.items()}
    for vi in g.input:
        if vi.name not in shapes:
            continue
        dims = list(shapes[vi.name])
        if batch > 1:
            dims[0] = batch
        shape = vi.type.tensor_type.shape
        shape.Clear()
        for d in dims:
            shape.dim.add().dim_value = int(d)
    fixes: list[str] = []
    if batch > 1:
        scratch = g if ir_fix else onnx.GraphProto()
        if not ir_fix:
            scratch.CopyFrom(g)
        consts, carriers = _Consts(scratch), _carriers(scratch)
        fixes = _fix_reshapes(scratch, consts, carriers, dim0) + _fix_concats(scratch, consts, carriers, batch)
        if fixes and not ir_fix:  # left as they are, these mix the samples of a batch or fail later
            raise PulsarError(f"{what}: {fixes[0].split(':')[0]} has batch 1 baked into a constant "
                              f"({fixes[0].split(': ', 1)[1]} would carry the batch) and compiler.disable_ir_fix "
                              "is true: patch it with const_processors, or set disable_ir_fix false")
    del g.value_info[:]
    for out in g.output:
        if out.type.HasField("tensor_type"):
            out.type.tensor_type.ClearField("shape")
    if batch > 1:
        hint = ("patch the constant with const_processors (dim 0 to -1 or 0) or compile without multi-batch"
                if not ir_fix else "the batch cannot be carried through it automatically: patch its constant "
                "input with const_processors, or compile without multi-batch")
    else:
        hint = "drop this shape from src_extra_shapes, or patch the node's constants with const_processors"
    inferred = {o.name: o for o in _check(model, what, hint).output}
    for out in g.output:  # the outputs' new shapes, as the rest of the graph's are re-inferred by lowering
        if out.name in inferred and inferred[out.name].type.tensor_type.HasField("shape"):
            out.type.tensor_type.shape.CopyFrom(inferred[out.name].type.tensor_type.shape)
    _run_once(model, what, hint)
    if batch > 1:
        own = {vi.name: _dims(vi) for vi in qmodel.graph.input}
        single = qmodel if all(own.get(n) == list(d) for n, d in shapes.items()) else \
            reshaped(qmodel, shapes, batch=1, ir_fix=ir_fix, what=what)[0]
        _same_as_single_samples(single, model, batch, what, fixes)
    return model, fixes
