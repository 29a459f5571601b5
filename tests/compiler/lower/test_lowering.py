"""Lowering a QDQ model into NPU (integer) and CPU (float) subgraphs.

Models are built with onnx.helper, quantized by pulsar (or by onnxruntime's quantizer) and lowered.
Three properties are checked: (1) CPU bodies + NPU reference bodies run in order reproduce the
whole QDQ model exactly in onnxruntime; (2) structure: op types, shared weight names, value_info,
fallback reasons; (3) the integer bodies, run by the NPU simulator, agree with the reference
bodies within one quantization step (per op, each fed the reference's integer inputs, and per
body for shallow models).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import pulsar
from pulsar.compiler.lower import INT_DOMAIN, LowerOptions, lower_qdq_model
from pulsar.core.container import Subgraph, load_compiled, package
from pulsar.core.ort_options import reference_session_options
from pulsar.errors import PulsarError
from pulsar.runtime.npu_sim import NpuProgram
from tests.compiler.test_int_ops import body_model

INT_TYPES = {TensorProto.UINT8, TensorProto.INT8, TensorProto.UINT16, TensorProto.INT16, TensorProto.INT32,
             TensorProto.INT64}


# --------------------------------------------------------------------------- models


def make_zoo(path: Path, seed: int = 0) -> Path:
    """One graph with every op family: conv+relu, depthwise+clip, pools, add/sub/mul, concat of two
    grids, a LUT op, gemm, reshape/transpose, matmul of two activations, softmax, layernorm."""
    rng = np.random.default_rng(seed)

    def w(name: str, *shape: int, scale: float = 0.3) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    def c(name: str, value) -> onnx.TensorProto:
        return numpy_helper.from_array(np.asarray(value), name)

    inits = [w("c1.w", 8, 4, 3, 3), w("c1.b", 8, scale=0.1), w("dw.w", 8, 1, 3, 3), w("dw.b", 8, scale=0.1),
             w("fc.w", 10, 16), w("fc.b", 10, scale=0.1), c("six", np.float32(6.0)), c("zero", np.float32(0.0)),
             c("shape3", np.array([1, 16, 16], np.int64)), w("ln.g", 16, scale=0.5), w("ln.b", 16, scale=0.2),
             w("mw", 16, 12), c("half", np.float32(0.5))]
    n = helper.make_node
    nodes = [
        n("Conv", ["x", "c1.w", "c1.b"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        n("Relu", ["c1"], ["r1"], name="relu1"),
        n("Conv", ["r1", "dw.w", "dw.b"], ["dw"], name="dwconv", pads=[1, 1, 1, 1], group=8),
        n("Clip", ["dw", "zero", "six"], ["cl"], name="clip6"),
        n("MaxPool", ["cl"], ["mp"], name="maxpool", kernel_shape=[2, 2], strides=[2, 2]),
        n("AveragePool", ["r1"], ["ap"], name="avgpool", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        n("Add", ["mp", "ap"], ["ad"], name="add"),
        n("Sub", ["mp", "ap"], ["sb"], name="sub"),
        n("Mul", ["ad", "sb"], ["ml"], name="mul"),
        n("Concat", ["ad", "ml"], ["cat"], name="concat", axis=1),
        n("Sigmoid", ["cat"], ["sg"], name="sigmoid"),
        n("GlobalAveragePool", ["sg"], ["gp"], name="gap"),
        n("Flatten", ["gp"], ["fl"], name="flatten"),
        n("Gemm", ["fl", "fc.w", "fc.b"], ["logits"], name="fc", transB=1),
        n("Softmax", ["logits"], ["probs"], name="probs_softmax", axis=-1),
        n("Reshape", ["cat", "shape3"], ["rs"], name="reshape"),
        n("Transpose", ["rs"], ["tr"], name="transpose", perm=[0, 2, 1]),
        n("MatMul", ["tr", "rs"], ["mm"], name="matmul_act"),
        n("Mul", ["mm", "half"], ["mmh"], name="scale_half"),
        n("Softmax", ["mmh"], ["sm"], name="softmax", axis=-1),
        n("LayerNormalization", ["mm", "ln.g", "ln.b"], ["ln"], name="layernorm", axis=-1),
        n("MatMul", ["sm", "ln"], ["att"], name="matmul_att"),
        n("MatMul", ["att", "mw"], ["proj"], name="matmul_w"),
    ]
    graph = helper.make_graph(nodes, "zoo", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
                              [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [1, 10]),
                               helper.make_tensor_value_info("proj", TensorProto.FLOAT, [1, 16, 12])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def make_zoo2(path: Path, seed: int = 1) -> Path:
    """The other op families: deconvolution, Pad, SAME / 1-D convolutions, Resize, Split, Gather,
    constant operands (Add per channel, Mul / Div by a scalar, constant - x), ReduceMean / ReduceSum,
    Gemm alpha, more tables (Tanh, Exp, HardSwish, PRelu), a lookup-table chain."""
    rng = np.random.default_rng(seed)

    def w(name: str, *shape: int, scale: float = 0.3) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    def c(name: str, value) -> onnx.TensorProto:
        return numpy_helper.from_array(np.asarray(value), name)

    inits = [w("ct.w", 4, 6, 2, 2), w("ct.b", 6, scale=0.1), w("cs.w", 4, 4, 3, 3), w("c1d.w", 4, 10, 3),
             c("pads", np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64)),
             c("scales", np.array([1, 1, 3.2, 3.2], np.float32)), c("split", np.array([5, 5], np.int64)),
             w("chan", 1, 5, 1, 1, scale=1.0), c("k17", np.float32(1.7)), c("three", np.float32(3.0)),
             c("idx", np.array([0, 2, 4], np.int64)), c("slope", np.float32(0.1)),
             c("shape3", np.array([1, 10, 256], np.int64)), c("axis2", np.array([2], np.int64)),
             w("g.w", 4, 6), w("g.b", 6, scale=0.1), c("two", np.float32(2.0)), c("one", np.float32(1.0))]
    n = helper.make_node
    nodes = [
        n("ConvTranspose", ["x", "ct.w", "ct.b"], ["ct"], name="deconv", strides=[2, 2]),
        n("Pad", ["x", "pads"], ["pd"], name="pad"),
        n("Tanh", ["pd"], ["th"], name="tanh"),
        n("Conv", ["th", "cs.w"], ["cs"], name="conv_same", auto_pad="SAME_UPPER", strides=[2, 2]),
        n("Resize", ["cs", "", "scales"], ["rz"], name="resize", mode="nearest"),
        n("Concat", ["ct", "rz"], ["cat2"], name="concat2", axis=1),
        n("Split", ["cat2", "split"], ["sp0", "sp1"], name="split", axis=1),
        n("Add", ["sp0", "chan"], ["a1"], name="add_const"),
        n("Mul", ["sp1", "k17"], ["m1"], name="mul_const"),
        n("Div", ["a1", "three"], ["dv"], name="div_const"),
        n("PRelu", ["dv", "slope"], ["pr"], name="prelu"),
        n("ReduceMean", ["m1"], ["rm"], name="reduce_mean", axes=[2, 3], keepdims=1),
        n("Gather", ["cat2", "idx"], ["ga"], name="gather", axis=1),
        n("Exp", ["ga"], ["ex"], name="exp"),
        n("Reshape", ["cat2", "shape3"], ["r3"], name="reshape3"),
        n("Conv", ["r3", "c1d.w"], ["c1d"], name="conv1d", pads=[1, 1]),
        n("HardSwish", ["c1d"], ["hs"], name="hardswish"),
        n("ReduceSum", ["hs", "axis2"], ["rsum"], name="reduce_sum", keepdims=0),
        n("Gemm", ["rsum", "g.w", "g.b"], ["gm"], name="gemm_alpha", alpha=0.5),
        n("Sub", ["three", "gm"], ["csub"], name="const_sub"),
        n("Sigmoid", ["m1"], ["s1"], name="chain_sigmoid"),  # a lookup-table chain: 2 * sigmoid(x) - 1
        n("Mul", ["s1", "two"], ["s2"], name="chain_mul"),
        n("Sub", ["s2", "one"], ["chain"], name="chain_sub"),
    ]
    outputs = [("pr", [1, 5, 16, 16]), ("rm", [1, 5, 1, 1]), ("ex", [1, 3, 16, 16]), ("csub", [1, 6]),
               ("chain", [1, 5, 16, 16])]
    graph = helper.make_graph(nodes, "zoo2", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, s) for o, s in outputs],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def _calib(folder: Path, shape: tuple[int, ...], n: int = 8) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    for i in range(n):
        np.save(folder / f"{i:03d}.npy", rng.standard_normal(shape).astype(np.float32))
    return folder


def _config(name: str, calib: Path, layer_configs: list | None = None) -> dict:
    quant: dict = {"input_configs": [{"tensor_name": name, "calibration_dataset": str(calib),
                                      "calibration_format": "Numpy", "calibration_size": 8}]}
    if layer_configs:
        quant["layer_configs"] = layer_configs
    return {"quant": quant, "compiler": {"check": 0}}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, tiny: dict[str, Path]) -> dict[str, onnx.ModelProto]:
    """QDQ models: the tiny CNN, the zoo at 8 bits and with 16-bit layers, onnxruntime's QDQ of the CNN."""
    root = tmp_path_factory.mktemp("lower")
    zoo = make_zoo(root / "zoo.onnx")
    zcal = _calib(root / "zcal", (1, 4, 8, 8))
    out = {}
    res = pulsar.build(tiny["model"], root / "tiny", _config("image", tiny["calib"]), quiet=True)
    out["tiny"] = onnx.load(res.quantized_model)
    res = pulsar.build(zoo, root / "u8", _config("x", zcal), quiet=True)
    out["u8"] = onnx.load(res.quantized_model)
    wide = [{"op_types": ["Softmax", "LayerNormalization", "Sigmoid", "MatMul"], "data_type": "U16"},
            {"layer_name": "conv1", "data_type": "U16", "weight_data_type": "S16"}]
    cfg = _config("x", zcal, wide)
    cfg["quant"]["conv_bias_data_type"] = "FP32"  # float biases: the lowering puts them on the int64 grid
    res = pulsar.build(zoo, root / "u16", cfg, quiet=True)
    out["u16"] = onnx.load(res.quantized_model)
    manual = [{"op_types": ["Div", "ReduceMean", "ReduceSum", "Exp"], "data_type": "U8"}]
    res = pulsar.build(make_zoo2(root / "zoo2.onnx"), root / "ops2", _config("x", zcal, manual), quiet=True)
    out["ops2"] = onnx.load(res.quantized_model)
    out["ort"] = _ort_qdq(tiny, root / "ort_qdq.onnx")
    return out


def _ort_qdq(tiny: dict[str, Path], dest: Path) -> onnx.ModelProto:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    samples = [np.load(p) for p in sorted(Path(tiny["calib"]).glob("*.npy"))]

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter(samples)

        def get_next(self):
            x = next(self.it, None)
            return None if x is None else {"image": x}

    quantize_static(str(tiny["model"]), str(dest), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8)
    return onnx.load(dest)


# --------------------------------------------------------------------------- running


def _session(graph: onnx.GraphProto, lowered, qmodel: onnx.ModelProto) -> ort.InferenceSession:
    opsets = [o for o in lowered.opset_imports if o.domain != INT_DOMAIN]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = qmodel.ir_version
    return ort.InferenceSession(model.SerializeToString(), reference_session_options(),
                                providers=["CPUExecutionProvider"])


def _feeds(qmodel: onnx.ModelProto, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
            for i in qmodel.graph.input}


def _pipeline(lowered, qmodel: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every subgraph in order: CPU bodies and NPU reference bodies in onnxruntime."""
    env = dict(feeds)
    for sg in lowered.subgraphs:
        graph = sg.graph if sg.kind == "cpu" else lowered.references[sg.name]
        outs = _session(graph, lowered, qmodel).run(None, {i.name: env[i.name] for i in graph.input})
        env.update(zip([o.name for o in graph.output], outs, strict=True))
    return env


def _reference_with_internals(graph: onnx.GraphProto, lowered, qmodel, feeds) -> dict[str, np.ndarray]:
    """A reference body's outputs plus every integer tensor inside it."""
    g = onnx.GraphProto()
    g.CopyFrom(graph)
    names = [o.name for o in g.output]
    for vi in graph.value_info:
        if vi.type.tensor_type.elem_type in INT_TYPES and vi.name not in names:
            g.output.append(vi)
            names.append(vi.name)
    values = dict(zip(names, _session(g, lowered, qmodel).run(names, feeds), strict=True))
    return {**feeds, **values}


def _diffs(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    assert got.shape == want.shape and got.dtype == want.dtype
    return np.abs(got.astype(np.int64) - want.astype(np.int64)).ravel()


def per_op_agreement(lowered, qmodel, seeds=(0, 1)) -> dict[str, np.ndarray]:
    """node name -> |integer - reference| of its outputs, each integer node fed the reference's inputs."""
    out: dict[str, list[np.ndarray]] = {}
    for seed in seeds:
        env = _pipeline(lowered, qmodel, _feeds(qmodel, seed))
        for sg in lowered.subgraphs:
            if sg.kind != "npu":
                continue
            body = sg.graph
            ref = _reference_with_internals(lowered.references[sg.name], lowered, qmodel,
                                            {i.name: env[i.name] for i in body.input})
            infos = {v.name: v for v in [*body.input, *body.value_info, *body.output]}
            inits = {t.name: t for t in body.initializer}
            mine: dict[str, np.ndarray] = {}
            for node in body.node:
                feeds = {i: ref.get(i, mine.get(i)) for i in node.input if i and i not in inits}
                one = helper.make_graph([node], node.name, [infos[i] for i in feeds], [infos[o] for o in node.output],
                                        initializer=[inits[i] for i in node.input if i in inits])
                result = NpuProgram(one).run(feeds)
                mine.update(result)
                for name, value in result.items():
                    if name in ref:
                        out.setdefault(node.name, []).append(_diffs(value, ref[name]))
    return {k: np.concatenate(v) for k, v in out.items()}


def body_agreement(lowered, qmodel, seeds=(0, 1)) -> np.ndarray:
    """|integer body - reference body| over every NPU subgraph output, fed the same integer inputs."""
    diffs = []
    for seed in seeds:
        env = _pipeline(lowered, qmodel, _feeds(qmodel, seed))
        for sg in lowered.subgraphs:
            if sg.kind == "npu":
                got = NpuProgram(sg.graph).run({i.name: env[i.name] for i in sg.graph.input})
                diffs += [_diffs(got[o.name], env[o.name]) for o in sg.graph.output]
    return np.concatenate(diffs)


def _within1(d: np.ndarray) -> float:
    return float((d <= 1).mean())


# --------------------------------------------------------------------------- structure helpers


def _ops(lowered, kind: str = "npu") -> list[str]:
    return [n.op_type for sg in lowered.subgraphs if sg.kind == kind for n in sg.graph.node]


def _node(lowered, name: str) -> onnx.NodeProto:
    return next(n for sg in lowered.subgraphs for n in sg.graph.node if n.name == name)


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _check_self_contained(graph: onnx.GraphProto, *, integer: bool) -> None:
    """Every tensor is an input, an initializer or produced, and has a type and a static shape."""
    typed = {v.name: v for v in [*graph.input, *graph.value_info, *graph.output]}
    inits = {t.name for t in graph.initializer}
    produced = {o for n in graph.node for o in n.output if o}
    for n in graph.node:
        for name in [*n.input, *n.output]:
            if not name or name in inits:
                continue
            assert name in produced or name in typed and name in {i.name for i in graph.input}, name
            t = typed[name].type.tensor_type
            assert t.elem_type and t.HasField("shape") and all(d.dim_value > 0 for d in t.shape.dim), name
            if integer:
                assert t.elem_type in INT_TYPES, (name, t.elem_type)
    if integer:  # integer initializers too, except a Resize's float scales (a non-integer ratio)
        scales = {n.input[2] for n in graph.node if n.op_type == "Resize" and len(n.input) > 2}
        assert all(t.data_type in INT_TYPES for t in graph.initializer if t.name not in scales)


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("which", ["tiny", "u8", "u16", "ops2", "ort"])
def test_subgraphs_in_order_reproduce_the_qdq_model_exactly(built, which):
    qmodel = built[which]
    lowered = lower_qdq_model(qmodel)
    whole = ort.InferenceSession(qmodel.SerializeToString(), reference_session_options(),
                                 providers=["CPUExecutionProvider"])
    for seed in (0, 1):
        feeds = _feeds(qmodel, seed)
        env = _pipeline(lowered, qmodel, feeds)
        for out, want in zip(whole.get_outputs(), whole.run(None, feeds), strict=True):
            np.testing.assert_array_equal(env[out.name], want)
    # model inputs / outputs stay float; bodies have the same interface in both NPU forms
    assert [v.name for v in lowered.inputs] == [i.name for i in qmodel.graph.input]
    assert [v.name for v in lowered.outputs] == [o.name for o in qmodel.graph.output]
    assert lowered.subgraphs[0].kind == "cpu" and lowered.subgraphs[-1].kind == "cpu"
    kinds = [sg.kind for sg in lowered.subgraphs]
    assert all(a != b for a, b in zip(kinds, kinds[1:], strict=False))  # a new subgraph only on a change
    for sg in lowered.subgraphs:
        _check_self_contained(sg.graph, integer=sg.kind == "npu")
        if sg.kind == "npu":
            ref = lowered.references[sg.name]
            _check_self_contained(ref, integer=False)
            assert [(v.name, v.type) for v in ref.input] == [(v.name, v.type) for v in sg.graph.input]
            assert [(v.name, v.type) for v in ref.output] == [(v.name, v.type) for v in sg.graph.output]
            assert {n.domain for n in sg.graph.node} <= {INT_DOMAIN, ""}
            # the pulsar.int schemas (pulsar/core/int_ops.py) cover every op and attribute the lowering writes
            onnx.checker.check_model(body_model(sg.graph, lowered.opset_imports, qmodel.ir_version), full_check=True)


def test_tiny_cnn_structure_and_agreement(built, tmp_path):
    qmodel = built["tiny"]
    lowered = lower_qdq_model(qmodel)
    assert [sg.name for sg in lowered.subgraphs] == ["cpu_0", "npu_0", "cpu_1"]
    assert [n.op_type for n in lowered.subgraphs[0].graph.node] == ["QuantizeLinear"]
    assert [n.op_type for n in lowered.subgraphs[2].graph.node] == ["DequantizeLinear"]
    body = lowered.subgraphs[1].graph
    assert [n.op_type for n in body.node] == ["QConv", "QConv", "QConv", "QAdd", "QReduceMean", "Flatten", "QMatMul"]
    assert [n.name for n in body.node][:3] == ["conv1", "dwconv", "conv2"]  # original names: reports map back
    assert lowered.fallbacks == [] and set(lowered.placement.values()) == {"npu"}
    # the fused Relu is the clamp at the output zero point
    conv1 = _attrs(_node(lowered, "conv1"))
    assert conv1["out_min"] == conv1["out_zp"] and conv1["out_max"] == 255
    assert _attrs(_node(lowered, "dwconv"))["group"] == 8
    # weights keep their QDQ names and content in both bodies (stored once by the packager)
    ref_inits = {t.name: t for t in lowered.references["npu_0"].initializer}
    q_inits = {t.name: t for t in qmodel.graph.initializer}
    for t in body.initializer:
        if t.name in ref_inits:
            assert t.SerializeToString() == ref_inits[t.name].SerializeToString() == q_inits[t.name].SerializeToString()
    assert {"c1.w/q", "dw.w/q", "c2.w/q", "fc.w/q", "c1.b/q", "fc.b/q"} <= {t.name for t in body.initializer}
    # packaged next to its reference body, every weight is stored once (same name, same content)
    refs = [Subgraph(f"{name}_reference", "npu", graph) for name, graph in lowered.references.items()]
    path = package([*lowered.subgraphs, *refs], inputs=lowered.inputs, outputs=lowered.outputs,
                   opset_imports=lowered.opset_imports, metadata={}, path=tmp_path / "m.pulsar")
    stored = [t.name for t in load_compiled(path).model.graph.initializer]
    assert "c1.w/q" in stored and not [n for n in stored if "__" in n]
    assert _within1(body_agreement(lowered, qmodel)) >= 0.999


def test_zoo_8bit_every_op_family_on_the_npu(built):
    qmodel = built["u8"]
    lowered = lower_qdq_model(qmodel)
    ops = set(_ops(lowered))
    assert {"QConv", "QAvgPool", "MaxPool", "QAdd", "QMul", "Requantize", "Concat", "QLut", "QReduceMean", "Flatten",
            "QMatMul", "Reshape", "Transpose", "QSoftmax", "QLayerNorm"} <= ops
    assert all(op not in ops for op in ("Conv", "QuantizeLinear", "DequantizeLinear", "Sigmoid"))
    assert _attrs(_node(lowered, "sub"))["Mb"] < 0 < _attrs(_node(lowered, "add"))["Mb"]
    clip = _attrs(_node(lowered, "dwconv"))  # Clip(0, 6) fused: the clamp bounds are Q(0) and Q(6)
    assert clip["out_min"] == clip["out_zp"] and clip["out_max"] <= 255
    assert any(n.name.startswith("concat/requant_in") for n in lowered.subgraphs[1].graph.node)  # two grids
    matmul = _node(lowered, "matmul_act")
    assert list(matmul.input[:2]) == ["tr/q", "rs/q"] and _attrs(matmul)["trans_b"] == 0  # two activations
    table = next(t for t in lowered.subgraphs[1].graph.initializer if t.name == "sigmoid/table")
    assert list(table.dims) == [256] and table.data_type == TensorProto.INT32
    # the Softmax that writes a float model output stays on the CPU, with a reason saying how to move it
    (fb,) = lowered.fallbacks
    assert (fb.node, fb.op_type) == ("probs_softmax", "Softmax")
    assert "manual op" in fb.reason and "layer_configs" in fb.reason and "U16" in fb.reason
    assert lowered.placement["softmax"] == "npu" and lowered.placement["probs_softmax"] == "cpu"
    per_op = per_op_agreement(lowered, qmodel)
    assert _within1(np.concatenate(list(per_op.values()))) >= 0.999
    assert max(int(d.max()) for d in per_op.values()) <= 1
    body = body_agreement(lowered, qmodel)  # errors of one step can grow through a chain of ops
    assert _within1(body) >= 0.9 and body.max() <= 4


def test_zoo_16bit_lut_softmax_layernorm_and_float_bias(built):
    qmodel = built["u16"]
    lowered = lower_qdq_model(qmodel)
    sig = _node(lowered, "sigmoid")
    assert sig.op_type == "QLut" and _attrs(sig)["step_bits"] == 6  # default: 2**10 + 1 knots
    table = next(t for sg in lowered.subgraphs for t in sg.graph.initializer if t.name == "sigmoid/table")
    assert list(table.dims) == [1025]
    finer = lower_qdq_model(qmodel, LowerOptions(lut_items_in_bits=12))
    assert _attrs(_node(finer, "sigmoid"))["step_bits"] == 4
    assert _node(lowered, "softmax").op_type == "QSoftmax" and _attrs(_node(lowered, "softmax"))["to"] == TensorProto.UINT16
    assert _node(lowered, "layernorm").op_type == "QLayerNorm"
    assert _node(lowered, "layernorm/beta").op_type == "QAdd"  # beta added before the one rounding
    # biases kept float in the QDQ model (as a 16-bit layer's bias that overflows int32): the lowering
    # rounds them onto the accumulator grid as int64
    assert {"c1.b", "fc.b"} <= {t.name for t in qmodel.graph.initializer}
    for node in ("conv1", "fc"):
        bias = _node(lowered, node).input[2]
        init = next(t for sg in lowered.subgraphs for t in sg.graph.initializer if t.name == bias)
        assert bias == f"{node}/bias" and init.data_type == TensorProto.INT64
    per_op = per_op_agreement(finer, qmodel)
    assert _within1(np.concatenate(list(per_op.values()))) >= 0.999
    coarse = per_op_agreement(lowered, qmodel, seeds=(0,))
    assert _within1(coarse["sigmoid"]) >= 0.9 and coarse["sigmoid"].max() <= 3  # interpolation error


def test_zoo2_constants_deconvolution_resize_and_reductions(built):
    qmodel = built["ops2"]
    lowered = lower_qdq_model(qmodel)
    assert not lowered.fallbacks
    body = next(sg.graph for sg in lowered.subgraphs if sg.kind == "npu")
    inits = {t.name: numpy_helper.to_array(t) for t in body.initializer}
    assert _node(lowered, "deconv").op_type == "QConvTranspose"
    assert list(_node(lowered, "pad").input) == ["x/q", "pads", "pad/value"]
    x_zp = _attrs(_node(lowered, "deconv"))["x_zp"]
    assert int(inits["pad/value"]) == x_zp and inits["pad/value"].dtype == np.uint8  # pads with real 0
    assert _attrs(_node(lowered, "conv_same"))["pads"] == [0, 0, 1, 1]  # SAME_UPPER resolved
    assert _attrs(_node(lowered, "conv1d"))["pads"] == [1, 1]
    assert _node(lowered, "resize").op_type == "Resize"
    assert [n.op_type for n in body.node if n.name.startswith("gather")] == ["Gather", "Requantize"]
    assert _node(lowered, "add_const").op_type == "QAdd" and inits["add_const/const"].dtype == np.int64
    assert _node(lowered, "div_const").op_type == "QMul" and _node(lowered, "mul_const").op_type == "QMul"
    assert _attrs(_node(lowered, "const_sub"))["Ma"] < 0  # 3 - x
    assert _node(lowered, "reduce_sum").op_type == "QReduceMean" and _attrs(_node(lowered, "reduce_sum"))["axes"] == [2]
    assert inits["gemm_alpha/bias"].dtype == np.int64  # alpha moves the accumulator grid off the bias scale
    assert {_node(lowered, op).op_type for op in ("tanh", "exp", "hardswish", "prelu")} == {"QLut"}
    # conv1d -> HardSwish: the quantizer keeps the conv output at 16 bits (the table's input); the
    # interpolated table works on a finer int32 grid and one Requantize rounds onto the 8-bit output
    hswish = _attrs(_node(lowered, "hardswish"))
    assert hswish["step_bits"] == 6 and hswish["to"] == TensorProto.INT32
    assert _node(lowered, "hardswish/round").op_type == "Requantize"
    # the quantizer quantizes only the end of Sigmoid -> Mul 2 -> Sub 1: one table of the chain
    assert _node(lowered, "chain_sigmoid").op_type == "QLut"
    assert {lowered.placement[k] for k in ("chain_sigmoid", "chain_mul", "chain_sub")} == {"npu"}
    assert not any(n.name in ("chain_mul", "chain_sub") for n in body.node)
    assert list(_node(lowered, "chain_sigmoid").output) in (["chain/q"], ["chain_sigmoid/fine"])
    per_op = per_op_agreement(lowered, qmodel)
    assert _within1(np.concatenate(list(per_op.values()))) >= 0.999


def test_onnxruntime_qdq_model_lowers_with_its_own_names(built):
    qmodel = built["ort"]
    lowered = lower_qdq_model(qmodel)
    # onnxruntime's quantizer leaves BatchNormalization unfused: it stays on the CPU
    assert [(f.node, f.op_type) for f in lowered.fallbacks] == [("bn1", "BatchNormalization")]
    assert "not supported by the NPU" in lowered.fallbacks[0].reason
    assert [sg.kind for sg in lowered.subgraphs] == ["cpu", "npu", "cpu", "npu", "cpu"]
    assert all(i.name.endswith("_QuantizeLinear_Output") for sg in lowered.subgraphs if sg.kind == "npu"
               for i in sg.graph.input)
    assert _within1(body_agreement(lowered, qmodel)) >= 0.999


def test_gemm_beta_and_npu_ops_fall_back_with_reasons(built):
    qmodel = onnx.ModelProto()
    qmodel.CopyFrom(built["tiny"])
    fc = next(n for n in qmodel.graph.node if n.name == "fc")
    fc.attribute.append(helper.make_attribute("beta", 0.5))
    lowered = lower_qdq_model(qmodel)
    assert [(f.node, f.reason) for f in lowered.fallbacks] == [("fc", "Gemm beta != 1 (fold beta into the bias of the "
                                                                      "float model)")]
    assert [sg.kind for sg in lowered.subgraphs] == ["cpu", "npu", "cpu"]
    assert "Gemm" in [n.op_type for n in lowered.subgraphs[-1].graph.node]

    only_conv = lower_qdq_model(built["tiny"], LowerOptions(npu_ops={"Conv", "Relu"}))
    assert {f.op_type for f in only_conv.fallbacks} == {"Add", "GlobalAveragePool", "Flatten", "Gemm"}
    assert all("npu_ops" in f.reason for f in only_conv.fallbacks)
    whole = ort.InferenceSession(built["tiny"].SerializeToString(), reference_session_options(),
                                 providers=["CPUExecutionProvider"])
    feeds = _feeds(built["tiny"], 3)
    env = _pipeline(only_conv, built["tiny"], feeds)
    np.testing.assert_array_equal(env["logits"], whole.run(None, feeds)[0])


def _qdq_layernorm(width: int) -> onnx.ModelProto:
    """A hand-written 16-bit QDQ LayerNorm (com.microsoft Q / DQ) of ``width`` channels."""
    ms = "com.microsoft"
    inits = [numpy_helper.from_array(np.float32(0.001), "s"), numpy_helper.from_array(np.uint16(32768), "z"),
             numpy_helper.from_array(np.ones(width, np.float32), "g"),
             numpy_helper.from_array(np.zeros(width, np.float32), "b")]
    n = helper.make_node
    nodes = [n("QuantizeLinear", ["x", "s", "z"], ["x/q"], name="xq", domain=ms),
             n("DequantizeLinear", ["x/q", "s", "z"], ["x/dq"], name="xdq", domain=ms),
             n("LayerNormalization", ["x/dq", "g", "b"], ["y/float"], name="ln", axis=-1),
             n("QuantizeLinear", ["y/float", "s", "z"], ["y/q"], name="yq", domain=ms),
             n("DequantizeLinear", ["y/q", "s", "z"], ["y"], name="ydq", domain=ms)]
    graph = helper.make_graph(nodes, "ln", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, width])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ms, 1)])
    model.ir_version = 8
    return model


def test_layernorm_too_wide_for_int64_variance_stays_on_the_cpu():
    narrow = lower_qdq_model(_qdq_layernorm(64))
    assert narrow.placement["ln"] == "npu" and not narrow.fallbacks
    wide = lower_qdq_model(_qdq_layernorm(1200))  # 1200**3 * 65535**2 >= 2**62
    (fb,) = wide.fallbacks
    assert fb.node == "ln" and fb.reason.startswith("LayerNorm too wide for int64 variance")
    assert [sg.kind for sg in wide.subgraphs] == ["cpu"]


def test_fp32_layer_stays_on_the_cpu(tmp_path, tiny):
    cfg = _config("image", tiny["calib"], [{"layer_name": "conv2", "data_type": "FP32"}])
    qmodel = onnx.load(pulsar.build(tiny["model"], tmp_path / "out", cfg, quiet=True).quantized_model)
    lowered = lower_qdq_model(qmodel)
    reasons = {f.node: f.reason for f in lowered.fallbacks}
    assert "not quantized" in reasons["conv2"] and lowered.placement["conv1"] == "npu"
    assert [sg.kind for sg in lowered.subgraphs] == ["cpu", "npu", "cpu", "npu", "cpu"]


def test_lut_items_in_bits_is_checked(built):
    with pytest.raises(PulsarError, match="lut_items_in_bits"):
        lower_qdq_model(built["tiny"], LowerOptions(lut_items_in_bits=0))
