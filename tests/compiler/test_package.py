"""The compiled model container: structure, weight sharing, metadata and load errors."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from pulsar.compiler.package import package_qdq_model
from pulsar.core.container import FORMAT_VERSION, Subgraph, load_compiled, package
from pulsar.core.integrity import sealed_bytes
from pulsar.core.ort_options import reference_session_options
from pulsar.errors import PulsarError
from pulsar.runtime import Session

OPSET = [helper.make_opsetid("", 17)]
N = 64


def qdq_conv_model() -> onnx.ModelProto:
    """x -> Q/DQ -> Conv(per-channel int8 weights, int32 bias) -> Q/DQ -> y, opset 17."""
    rng = np.random.default_rng(0)
    c_in, c_out = 3, 4
    w_scale = (rng.random(c_out) * 0.02 + 0.005).astype(np.float32)
    x_scale = np.float32(0.03)
    inits = [
        numpy_helper.from_array(x_scale, "x_scale"),
        numpy_helper.from_array(np.uint8(128), "x_zp"),
        numpy_helper.from_array(rng.integers(-127, 128, (c_out, c_in, 3, 3)).astype(np.int8), "w_q"),
        numpy_helper.from_array(w_scale, "w_scale"),
        numpy_helper.from_array(np.zeros(c_out, np.int8), "w_zp"),
        numpy_helper.from_array(rng.integers(-500, 500, c_out).astype(np.int32), "b_q"),
        numpy_helper.from_array((w_scale * x_scale).astype(np.float32), "b_scale"),
        numpy_helper.from_array(np.zeros(c_out, np.int32), "b_zp"),
        numpy_helper.from_array(np.float32(0.05), "y_scale"),
        numpy_helper.from_array(np.int8(0), "y_zp"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["images", "x_scale", "x_zp"], ["x_q"]),
        helper.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zp"], ["x_dq"]),
        helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zp"], ["w_dq"], axis=0),
        helper.make_node("DequantizeLinear", ["b_q", "b_scale", "b_zp"], ["b_dq"], axis=0),
        helper.make_node("Conv", ["x_dq", "w_dq", "b_dq"], ["conv"], pads=[1, 1, 1, 1]),
        helper.make_node("QuantizeLinear", ["conv", "y_scale", "y_zp"], ["y_q"]),
        helper.make_node("DequantizeLinear", ["y_q", "y_scale", "y_zp"], ["output:0"]),
    ]
    graph = helper.make_graph(
        nodes,
        "qdq_conv",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, c_in, 8, 8])],
        [helper.make_tensor_value_info("output:0", TensorProto.FLOAT, [1, c_out, 8, 8])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=OPSET)
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _vi(name: str, shape=(1, N)) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def two_subgraphs(w_npu: np.ndarray, w_cpu: np.ndarray) -> list[Subgraph]:
    """NPU: x -> Q/DQ -> MatMul W -> h; CPU: h -> MatMul W -> Relu -> y. Both name their weight W."""
    npu = helper.make_graph(
        [
            helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["xq"]),
            helper.make_node("DequantizeLinear", ["xq", "s", "zp"], ["xdq"]),
            helper.make_node("MatMul", ["xdq", "W"], ["h"]),
        ],
        "npu",
        [_vi("x")],
        [_vi("h")],
        initializer=[
            numpy_helper.from_array(w_npu, "W"),
            numpy_helper.from_array(np.float32(0.02), "s"),
            numpy_helper.from_array(np.int8(0), "zp"),
        ],
    )
    cpu = helper.make_graph(
        [helper.make_node("MatMul", ["h", "W"], ["hw"]), helper.make_node("Relu", ["hw"], ["y"])],
        "cpu",
        [_vi("h")],
        [_vi("y")],
        initializer=[numpy_helper.from_array(w_cpu, "W")],
    )
    return [
        Subgraph("npu_0", "npu", npu, {"lut_items_in_bits": 8, "sub_config": 0}),
        Subgraph("cpu_1", "cpu", cpu, {"check_mode": "CheckPerLayer"}),
    ]


def expected_two(x: np.ndarray, w_npu: np.ndarray, w_cpu: np.ndarray) -> np.ndarray:
    """The same math as one plain ONNX graph in onnxruntime."""
    graph = helper.make_graph(
        [
            helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["xq"]),
            helper.make_node("DequantizeLinear", ["xq", "s", "zp"], ["xdq"]),
            helper.make_node("MatMul", ["xdq", "W1"], ["h"]),
            helper.make_node("MatMul", ["h", "W2"], ["hw"]),
            helper.make_node("Relu", ["hw"], ["y"]),
        ],
        "flat",
        [_vi("x")],
        [_vi("y")],
        initializer=[
            numpy_helper.from_array(w_npu, "W1"),
            numpy_helper.from_array(w_cpu, "W2"),
            numpy_helper.from_array(np.float32(0.02), "s"),
            numpy_helper.from_array(np.int8(0), "zp"),
        ],
    )
    model = helper.make_model(graph, opset_imports=OPSET)
    model.ir_version = 8
    sess = ort.InferenceSession(
        model.SerializeToString(), reference_session_options(), providers=["CPUExecutionProvider"]
    )
    return sess.run(None, {"x": x})[0]


def _package_two(path, w_npu, w_cpu, metadata=None):
    return package(
        two_subgraphs(w_npu, w_cpu),
        inputs=[_vi("x")],
        outputs=[_vi("y")],
        opset_imports=OPSET,
        metadata=metadata or {},
        path=path,
    )


def _weights(seed=1):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((N, N)).astype(np.float32) * 0.1


def test_qdq_model_container_structure(tmp_path):
    model = qdq_conv_model()
    path = package_qdq_model(model, tmp_path / "m.axmodel", {"target_hardware": "AX650"})
    loaded = onnx.load(str(path))  # standard tools open it
    onnx.checker.check_model(loaded)
    props = {p.key: p.value for p in loaded.metadata_props}
    assert props["pulsar.format"] == "pulsar-compiled-model"
    assert props["pulsar.format_version"] == str(FORMAT_VERSION) == "3"
    assert props["pulsar.version"]
    assert props["pulsar.target_hardware"] == "AX650"  # a string is stored as it is, not JSON-quoted
    domains = {op.domain: op.version for op in loaded.opset_import}
    assert domains == {"": 17, "pulsar.npu": 1, "pulsar.cpu": 1, "pulsar.int": 1}
    # lowered: the input Quantize / output Dequantize on the CPU around one integer NPU subgraph
    kinds = [(n.op_type, n.domain) for n in loaded.graph.node]
    assert kinds == [("CpuSubgraph", "pulsar.cpu"), ("NpuSubgraph", "pulsar.npu"), ("CpuSubgraph", "pulsar.cpu")]
    node = loaded.graph.node[1]
    attrs = {a.name: a for a in node.attribute}
    assert set(attrs) == {"body", "reference_body", "name", "kind", "options"}
    assert attrs["kind"].s == b"npu" and json.loads(attrs["options"].s) == {}
    assert {n.domain for n in attrs["body"].g.node} == {"pulsar.int"}
    assert [n.op_type for n in attrs["reference_body"].g.node if n.op_type == "Conv"] == ["Conv"]
    assert list(node.input) == list(n.name for n in attrs["reference_body"].g.input)
    # every weight lives at the top level, the bodies only refer to it; the int8 weight is shared by
    # the integer program and the reference fragment
    assert len(attrs["body"].g.initializer) == 0 and len(attrs["reference_body"].g.initializer) == 0
    top = {t.name for t in loaded.graph.initializer}
    assert {"w_q", "b_q"} <= top
    # default inputs / outputs metadata comes from the model
    compiled = load_compiled(path)
    assert compiled.metadata["inputs"] == [{"name": "images", "dtype": "float32", "shape": [1, 3, 8, 8]}]
    assert compiled.metadata["outputs"][0]["name"] == "output:0"
    assert compiled.format_version == 3
    sg = compiled.subgraphs[1]
    assert (sg.name, sg.kind) == ("npu_0", "npu") and sg.reference is not None
    assert "w_q" in {t.name for t in sg.graph.initializer} and "w_q" in {t.name for t in sg.reference.initializer}


def test_metadata_round_trips(tmp_path):
    metadata = {
        "target_hardware": "AX650",
        "npu_mode": "NPU3",
        "config_hash": "3f2a9c",
        "inputs": [{"name": "x", "dtype": "float32", "shape": [1, N]}],
        "batch_sizes": [1, 4],
        "nested": {"a": [1, 2.5, None, True]},
    }
    path = _package_two(tmp_path / "two.axmodel", _weights(), _weights(), metadata)
    compiled = load_compiled(path)
    assert compiled.metadata == metadata
    assert compiled.pulsar_version == "0.1.0" or compiled.pulsar_version[0].isdigit()
    assert [(s.name, s.kind, s.options) for s in compiled.subgraphs] == [
        ("npu_0", "npu", {"lut_items_in_bits": 8, "sub_config": 0}),
        ("cpu_1", "cpu", {"check_mode": "CheckPerLayer"}),
    ]


def test_reserved_metadata_key_is_refused(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        _package_two(tmp_path / "m", _weights(), _weights(), {"format_version": 2})


def test_shared_weight_is_stored_once(tmp_path):
    w = _weights()
    path = _package_two(tmp_path / "two.axmodel", w, w.copy())
    model = onnx.load(str(path))
    assert [t.name for t in model.graph.initializer].count("W") == 1
    assert sorted(t.name for t in model.graph.initializer) == ["W", "s", "zp"]
    assert path.stat().st_size < 1.5 * w.nbytes  # one copy of W, not two
    assert [n.op_type for n in model.graph.node] == ["NpuSubgraph", "CpuSubgraph"]
    assert model.graph.node[1].domain == "pulsar.cpu"
    # the border tensor h has its type recorded for viewers
    assert [v.name for v in model.graph.value_info] == ["h"]

    x = np.random.default_rng(2).standard_normal((1, N)).astype(np.float32)
    got = Session(path, mode="Reference").run({"x": x})
    np.testing.assert_array_equal(got["y"], expected_two(x, w, w))


def test_name_clash_with_different_content_is_renamed(tmp_path):
    w1, w2 = _weights(1), _weights(2)
    path = _package_two(tmp_path / "two.axmodel", w1, w2)
    names = sorted(t.name for t in onnx.load(str(path)).graph.initializer)
    assert names == ["W", "W__1", "s", "zp"]
    x = np.random.default_rng(3).standard_normal((1, N)).astype(np.float32)
    np.testing.assert_array_equal(Session(path, mode="Reference").run({"x": x})["y"], expected_two(x, w1, w2))


def test_loaded_subgraphs_repackage(tmp_path):
    w1, w2 = _weights(1), _weights(2)
    first = load_compiled(_package_two(tmp_path / "a.axmodel", w1, w2))
    again = package(
        first.subgraphs,
        inputs=list(first.model.graph.input),
        outputs=list(first.model.graph.output),
        opset_imports=list(first.model.opset_import),
        metadata=first.metadata,
        path=tmp_path / "b.axmodel",
    )
    x = np.random.default_rng(4).standard_normal((1, N)).astype(np.float32)
    np.testing.assert_array_equal(Session(again, mode="Reference").run({"x": x})["y"], expected_two(x, w1, w2))
    assert len(onnx.load(str(again)).graph.initializer) == 4


def test_rename_reaches_nested_graphs_and_keeps_outputs(tmp_path):
    """A weight named like another subgraph's weight (and like a model output) is renamed inside If
    branches too; a body output that was the weight itself stays an output via Identity."""

    def vi(name):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, [2])

    a = helper.make_graph(
        [helper.make_node("Add", ["x", "C"], ["h"])],
        "a",
        [vi("x")],
        [vi("h")],
        [numpy_helper.from_array(np.array([1, 2], np.float32), "C")],
    )
    then = helper.make_graph([helper.make_node("Mul", ["h", "C"], ["t"])], "then", [], [vi("t")])
    other = helper.make_graph([helper.make_node("Identity", ["C"], ["e"])], "else", [], [vi("e")])
    b = helper.make_graph(
        [helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)],
        "b",
        [vi("h")],
        [vi("y"), vi("C")],
        [
            numpy_helper.from_array(np.array([10, 20], np.float32), "C"),
            numpy_helper.from_array(np.array(True), "cond"),
        ],
    )
    path = package(
        [Subgraph("a", "npu", a), Subgraph("b", "cpu", b)],
        inputs=[vi("x")],
        outputs=[vi("y"), vi("C")],
        opset_imports=OPSET,
        metadata={},
        path=tmp_path / "nested.axmodel",
    )
    assert sorted(t.name for t in onnx.load(str(path)).graph.initializer) == ["C__1", "C__2", "cond"]
    got = Session(path, mode="Reference").run({"x": np.zeros(2, np.float32)})
    np.testing.assert_array_equal(got["y"], [10.0, 40.0])
    np.testing.assert_array_equal(got["C"], [10.0, 20.0])


def test_weights_listed_as_inputs_are_not_model_inputs(tmp_path):
    model = qdq_conv_model()
    for t in model.graph.initializer:  # the IR < 4 convention some exporters still follow
        model.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    path = package_qdq_model(model, tmp_path / "old.axmodel", {})
    sess = Session(path, mode="Reference")
    assert [i.name for i in sess.inputs] == ["images"]
    x = np.random.default_rng(0).standard_normal((1, 3, 8, 8)).astype(np.float32)
    assert sess.run({"images": x})["output:0"].shape == (1, 4, 8, 8)


# ----------------------------------------------------------------------------- load errors


@pytest.fixture
def compiled_path(tmp_path):
    return package_qdq_model(qdq_conv_model(), tmp_path / "model.axmodel", {})


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_missing_file(tmp_path):
    with pytest.raises(PulsarError, match="does not exist") as exc:
        load_compiled(tmp_path / "nope.axmodel")
    assert "nope.axmodel" in _one_line(exc)


def test_truncated_file(compiled_path):
    data = compiled_path.read_bytes()
    compiled_path.write_bytes(data[: len(data) // 2])
    with pytest.raises(PulsarError, match="is truncated or corrupt") as exc:
        load_compiled(compiled_path)
    assert str(compiled_path) in _one_line(exc)


def test_random_bytes(tmp_path):
    path = tmp_path / "noise.axmodel"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(PulsarError, match="truncated or corrupt") as exc:
        load_compiled(path)
    assert str(path) in _one_line(exc)


def test_plain_onnx(tmp_path):
    path = tmp_path / "plain.onnx"
    onnx.save(qdq_conv_model(), str(path))
    with pytest.raises(PulsarError, match=r"is not a pulsar compiled model .*pulsar build") as exc:
        load_compiled(path)
    assert str(path) in _one_line(exc)


def _edit(path, fn):
    """Change a compiled file and give it a valid checksum again: the structure checks must catch it."""
    model = onnx.load(str(path))
    fn(model)
    path.write_bytes(sealed_bytes(model))


def test_newer_format_version(compiled_path):
    def bump(model):
        for p in model.metadata_props:
            if p.key == "pulsar.format_version":
                p.value = "99"

    _edit(compiled_path, bump)
    with pytest.raises(PulsarError, match=r"newer pulsar \(format 99, this pulsar reads up to 3\)") as exc:
        load_compiled(compiled_path)
    assert "upgrade pulsar" in _one_line(exc)


def test_unknown_subgraph_domain(compiled_path):
    def retarget(model):
        model.graph.node[0].domain = "pulsar.gpu"

    _edit(compiled_path, retarget)
    with pytest.raises(PulsarError, match="unknown domain 'pulsar.gpu'") as exc:
        load_compiled(compiled_path)
    assert str(compiled_path) in _one_line(exc)
