"""Structural passes (fold_pad, fuse_matmul_add, merge_transpose_reshape, fold_affine_into_conv)
on small onnx.helper graphs and on the real PP-OCRv4 models, checked in onnxruntime."""

from __future__ import annotations

import importlib.resources

import numpy as np
import onnx
import pytest
from frontend_graphs import IR_VERSION, randn, tensor
from onnx import helper, numpy_helper

from pulsar.frontend.check import compare_models, run
from pulsar.frontend.graph import attr, consumers, initializers, producers
from pulsar.frontend.loader import apply_input_shapes, load_model
from pulsar.frontend.pass_manager import op_histogram, optimize
from pulsar.frontend.passes import DEFAULT_PASSES, PASSES

STRUCTURAL = ["fold_pad", "fuse_matmul_add", "merge_transpose_reshape", "fold_affine_into_conv"]


def make_model(
    nodes: list[onnx.NodeProto], inputs: list, outputs: list[str], inits: dict | None = None
) -> onnx.ModelProto:
    """A checked opset-17 model whose output types come from shape inference."""
    graph = helper.make_graph(
        nodes,
        "test",
        inputs,
        [helper.make_empty_tensor_value_info(name) for name in outputs],
        initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in (inits or {}).items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION)
    inferred = {vi.name: vi for vi in onnx.shape_inference.infer_shapes(model).graph.value_info}
    del model.graph.output[:]
    model.graph.output.extend(inferred[name] for name in outputs)
    onnx.checker.check_model(model)
    return model


def _apply(name: str, model: onnx.ModelProto) -> tuple[onnx.ModelProto, bool]:
    """Run one pass on a copy; the result must still pass the ONNX checker."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    changed = PASSES[name](copy)
    onnx.checker.check_model(copy)
    return copy, changed


def _assert_same(a: onnx.ModelProto, b: onnx.ModelProto, rtol: float = 1e-5) -> None:
    assert [o.name for o in a.graph.output] == [o.name for o in b.graph.output]
    for row in compare_models(a, b):
        assert row["rel_diff"] <= rtol, row


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def _unchanged(name: str, model: onnx.ModelProto) -> None:
    out, changed = _apply(name, model)
    assert not changed
    assert out.SerializeToString() == model.SerializeToString()


def test_structural_passes_registered_in_order():
    assert set(STRUCTURAL) <= set(PASSES) and set(STRUCTURAL) <= set(DEFAULT_PASSES)
    order = DEFAULT_PASSES.index
    assert order("fold_batchnorm") < order("fold_affine_into_conv") < order("eliminate_dead_nodes")
    assert order("remove_identity") < order("merge_transpose_reshape")


# --- fold_pad -----------------------------------------------------------------------------------


def _pad_model(
    consumer: str = "Conv",
    pad_amounts: list[int] | None = None,
    value: float | None = None,
    mode: str = "constant",
    pad_is_output: bool = False,
    extra_reader: bool = False,
    **consumer_attrs,
) -> onnx.ModelProto:
    """x [1,4,9,9] -> Pad -> Conv 3x3 / AveragePool / MaxPool -> y (Pad optionally read twice)."""
    pads = [0, 0, 1, 2, 0, 0, 2, 1] if pad_amounts is None else pad_amounts
    inits = {"pads": np.array(pads, np.int64), "w": randn(6, 4, 3, 3), "b": randn(6)}
    pad_inputs = ["x", "pads"]
    if value is not None:
        inits["value"] = np.array(value, np.float32)
        pad_inputs.append("value")
    nodes = [helper.make_node("Pad", pad_inputs, ["p"], name="pad", mode=mode)]
    if consumer == "Conv":
        nodes.append(helper.make_node("Conv", ["p", "w", "b"], ["y"], name="conv", **consumer_attrs))
    else:
        del inits["w"], inits["b"]
        nodes.append(helper.make_node(consumer, ["p"], ["y"], name="pool", **consumer_attrs))
    outputs = ["y"]
    if pad_is_output:
        outputs.append("p")
    if extra_reader:
        nodes.append(helper.make_node("Relu", ["p"], ["r"]))
        outputs.append("r")
    return make_model(nodes, [tensor("x", [1, 4, 9, 9])], outputs, inits)


@pytest.mark.parametrize(
    ("consumer", "value", "attrs", "expected_pads"),
    [
        ("Conv", None, {"pads": [1, 1, 1, 1]}, [2, 3, 3, 2]),
        ("Conv", 0.0, {"strides": [2, 2]}, [1, 2, 2, 1]),
        ("Conv", None, {"auto_pad": "VALID", "dilations": [2, 2]}, [1, 2, 2, 1]),
        (
            "AveragePool",
            0.0,
            {"kernel_shape": [3, 3], "count_include_pad": 1, "pads": [1, 0, 0, 1]},
            [2, 2, 2, 2],
        ),
        ("AveragePool", None, {"kernel_shape": [3, 3]}, [1, 2, 2, 1]),  # no own pads: counting is set
        ("MaxPool", float("-inf"), {"kernel_shape": [3, 3], "strides": [2, 2]}, [1, 2, 2, 1]),
    ],
)
def test_fold_pad_merges_into_consumer(consumer, value, attrs, expected_pads):
    model = _pad_model(consumer, value=value, **attrs)
    out, changed = _apply("fold_pad", model)
    assert changed and _ops(out) == [consumer]
    node = out.graph.node[0]
    assert node.input[0] == "x" and list(attr(node, "pads")) == expected_pads
    assert attr(node, "auto_pad") is None
    if consumer == "AveragePool":
        assert attr(node, "count_include_pad") == 1
    _assert_same(model, out)


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(_pad_model(value=0.5), id="non-zero value"),
        pytest.param(_pad_model(pad_amounts=[0, 1, 1, 1, 0, 0, 1, 1]), id="channel pad"),
        pytest.param(_pad_model(pad_amounts=[0, 0, -1, 1, 0, 0, 1, 1]), id="negative pad"),
        pytest.param(_pad_model(mode="reflect"), id="reflect mode"),
        pytest.param(_pad_model(pad_is_output=True), id="pad is a graph output"),
        pytest.param(_pad_model(extra_reader=True), id="pad read twice"),
        pytest.param(_pad_model(auto_pad="SAME_UPPER"), id="conv SAME padding"),
        pytest.param(
            _pad_model("AveragePool", kernel_shape=[3, 3], pads=[1, 1, 1, 1]), id="avgpool excludes own pads"
        ),
        pytest.param(_pad_model("AveragePool", kernel_shape=[3, 3], ceil_mode=1), id="avgpool ceil_mode"),
        pytest.param(_pad_model("MaxPool", kernel_shape=[3, 3]), id="maxpool zero pad"),
        pytest.param(
            _pad_model(
                "MaxPool", pad_amounts=[0, 0, 3, 0, 0, 0, 0, 0], value=float("-inf"), kernel_shape=[3, 3]
            ),
            id="maxpool window all padding",
        ),
    ],
)
def test_fold_pad_leaves_other_pads_alone(model):
    _unchanged("fold_pad", model)


def test_fold_pad_needs_constant_pads():
    nodes = [
        helper.make_node("Pad", ["x", "pads"], ["p"]),
        helper.make_node("Conv", ["p", "w"], ["y"]),
    ]
    model = make_model(
        nodes,
        [tensor("x", [1, 4, 9, 9]), tensor("pads", [8], onnx.TensorProto.INT64)],
        ["y"],
        {"w": randn(6, 4, 3, 3)},
    )
    _unchanged("fold_pad", model)


# --- fuse_matmul_add ----------------------------------------------------------------------------


def _linear_model(x_shape: list, bias_shape: tuple = (8,), bias_first: bool = False, **kw) -> onnx.ModelProto:
    """x -> MatMul(W [16, 8]) -> Add(bias) -> Relu -> y."""
    const_w, const_b = kw.get("const_w", True), kw.get("const_b", True)
    inits = {}
    inputs = [tensor("x", x_shape)]
    w, b = randn(16, 8), randn(*bias_shape)
    if const_w:
        inits["w"] = w
    else:
        inputs.append(tensor("w", [16, 8]))
    if const_b:
        inits["b"] = b
    else:
        inputs.append(tensor("b", list(bias_shape)))
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"], name="fc"),
        helper.make_node("Add", ["b", "mm"] if bias_first else ["mm", "b"], ["s"], name="fc_bias"),
        helper.make_node("Relu", ["s"], ["y"]),
    ]
    outputs = ["y"]
    if kw.get("mm_is_output"):
        outputs.append("mm")
    if kw.get("mm_read_twice"):
        nodes.append(helper.make_node("Sigmoid", ["mm"], ["z"]))
        outputs.append("z")
    return make_model(nodes, inputs, outputs, inits)


@pytest.mark.parametrize(
    ("x_shape", "bias_shape", "bias_first"),
    [([4, 16], (8,), False), (["N", 16], (1, 8), True), ([3, 16], (1,), False)],
)
def test_fuse_matmul_add_to_gemm(x_shape, bias_shape, bias_first):
    model = _linear_model(x_shape, bias_shape, bias_first)
    out, changed = _apply("fuse_matmul_add", model)
    assert changed and _ops(out) == ["Gemm", "Relu"]
    gemm = out.graph.node[0]
    assert list(gemm.input) == ["x", "w", "b"] and gemm.output[0] == "s" and gemm.name == "fc"
    _assert_same(model, out)


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(_linear_model([2, 4, 16]), id="rank-3 input"),
        pytest.param(_linear_model([4, 16], const_w=False), id="weight not constant"),
        pytest.param(_linear_model([4, 16], const_b=False), id="bias not constant"),
        pytest.param(_linear_model([4, 16], mm_is_output=True), id="product is a graph output"),
        pytest.param(_linear_model([4, 16], mm_read_twice=True), id="product read twice"),
        pytest.param(_linear_model([4, 16], bias_shape=(4, 1)), id="per-row bias"),
    ],
)
def test_fuse_matmul_add_leaves_others_alone(model):
    _unchanged("fuse_matmul_add", model)


# --- merge_transpose_reshape --------------------------------------------------------------------


def _chain(specs: list[tuple], x_shape: list, inits: dict | None = None, outputs_also: tuple = ()):
    """x -> op1 -> op2 ... -> Relu -> y; each spec is (op_type, extra inputs, attributes)."""
    nodes, prev = [], "x"
    for i, (op, extra, attrs) in enumerate(specs):
        nodes.append(helper.make_node(op, [prev, *extra], [f"t{i}"], name=f"n{i}", **attrs))
        prev = f"t{i}"
    nodes.append(helper.make_node("Relu", [prev], ["y"]))
    outputs = ["y", *outputs_also]
    return make_model(nodes, [tensor("x", x_shape)], outputs, inits or {})


def test_transpose_and_its_inverse_cancel():
    model = _chain(
        [("Transpose", [], {"perm": [0, 2, 3, 1]}), ("Transpose", [], {"perm": [0, 3, 1, 2]})], [1, 3, 4, 5]
    )
    out, changed = _apply("merge_transpose_reshape", model)
    assert changed and _ops(out) == ["Relu"] and out.graph.node[0].input[0] == "x"
    _assert_same(model, out)


def test_default_perm_transposes_cancel():
    model = _chain([("Transpose", [], {}), ("Transpose", [], {})], [2, 3, 4])
    out, changed = _apply("merge_transpose_reshape", model)
    assert changed and _ops(out) == ["Relu"]
    _assert_same(model, out)


def test_transposes_compose_into_one():
    model = _chain(
        [
            ("Transpose", [], {"perm": [1, 0, 2, 3]}),
            ("Transpose", [], {"perm": [0, 2, 3, 1]}),
            ("Transpose", [], {}),
        ],
        [2, 3, 4, 5],
    )
    out, changed = _apply("merge_transpose_reshape", model)
    assert changed and _ops(out) == ["Transpose", "Relu"]
    x = np.arange(120, dtype=np.float32).reshape(2, 3, 4, 5)
    expected = x.transpose(1, 0, 2, 3).transpose(0, 2, 3, 1).transpose(3, 2, 1, 0)
    axes = np.arange(4)[[1, 0, 2, 3]][[0, 2, 3, 1]][[3, 2, 1, 0]]  # output axis i = input axis axes[i]
    assert list(attr(out.graph.node[0], "perm")) == axes.tolist()
    np.testing.assert_array_equal(run(out, [{"x": x}])[0]["y"], expected)
    _assert_same(model, out)


def test_reshape_chain_keeps_last_reshape():
    inits = {"s1": np.array([6, 20], np.int64), "s2": np.array([0, 5, -1], np.int64)}
    model = _chain(
        [("Flatten", [], {"axis": 2}), ("Reshape", ["s1"], {}), ("Reshape", ["s2"], {})], [2, 3, 4, 5], inits
    )
    out, changed = _apply("merge_transpose_reshape", model)
    assert changed and _ops(out) == ["Reshape", "Relu"]
    reshape = out.graph.node[0]
    assert reshape.input[0] == "x"
    # the 0 copied a dim of the middle Reshape's output: spelt out before the input changed
    assert list(numpy_helper.to_array(initializers(out.graph)[reshape.input[1]])) == [6, 5, 4]
    _assert_same(model, out)


@pytest.mark.parametrize(
    ("first", "second", "x_shape"),
    [
        (("Unsqueeze", [1, -1]), ("Squeeze", [-1, 1]), ["N", 3, 4]),
        (("Squeeze", [2]), ("Unsqueeze", [-2]), [2, 3, 1, 4]),
        (("Squeeze", None), ("Unsqueeze", [0, 2]), [1, 3, 1, 4]),
    ],
)
def test_squeeze_unsqueeze_pairs_cancel(first, second, x_shape):
    inits, specs = {}, []
    for i, (op, axes) in enumerate([first, second]):
        extra = []
        if axes is not None:
            inits[f"axes{i}"] = np.array(axes, np.int64)
            extra = [f"axes{i}"]
        specs.append((op, extra, {}))
    model = _chain(specs, x_shape, inits)
    out, changed = _apply("merge_transpose_reshape", model)
    assert changed and _ops(out) == ["Relu"]
    _assert_same(model, out)


def test_squeeze_unsqueeze_of_other_axes_stay():
    inits = {"a0": np.array([2], np.int64), "a1": np.array([0], np.int64)}
    model = _chain([("Squeeze", ["a0"], {}), ("Unsqueeze", ["a1"], {})], [2, 3, 1, 4], inits)
    _unchanged("merge_transpose_reshape", model)


def test_reshape_with_runtime_shape_stays():
    nodes = [
        helper.make_node("Reshape", ["x", "s1"], ["t0"]),
        helper.make_node("Reshape", ["t0", "s2"], ["y"]),
    ]
    model = make_model(
        nodes,
        [tensor("x", [2, 12]), tensor("s2", [2], onnx.TensorProto.INT64)],
        ["y"],
        {"s1": np.array([4, 6], np.int64)},
    )
    _unchanged("merge_transpose_reshape", model)


def test_transpose_read_elsewhere_is_kept():
    """The second Transpose goes, the first stays for its other reader: no work is duplicated."""
    perm = {"perm": [0, 2, 1]}
    nodes = [
        helper.make_node("Transpose", ["x"], ["t0"], **perm),
        helper.make_node("Transpose", ["t0"], ["t1"], **perm),
        helper.make_node("Relu", ["t1"], ["y"]),
        helper.make_node("Sigmoid", ["t0"], ["z"]),
    ]
    model = make_model(nodes, [tensor("x", [2, 3, 4])], ["y", "z"])
    out, changed = _apply("merge_transpose_reshape", model)
    assert changed and _ops(out) == ["Transpose", "Relu", "Sigmoid"]
    assert producers(out.graph)["y"].input[0] == "x"
    _assert_same(model, out)


def test_cancelling_pair_with_outputs_keeps_interface():
    """Middle tensor and last tensor are graph outputs: names survive, values do not change."""
    model = _chain(
        [("Transpose", [], {"perm": [1, 0]}), ("Transpose", [], {"perm": [1, 0]})],
        [3, 4],
        outputs_also=("t0", "t1"),
    )
    out, changed = _apply("merge_transpose_reshape", model)
    assert changed and sorted(_ops(out)) == ["Identity", "Relu", "Transpose"]
    assert consumers(out.graph)["x"]  # Relu and Identity read x directly now
    _assert_same(model, out)
    cleaned, _ = optimize(model, ["merge_transpose_reshape", "remove_identity", "eliminate_dead_nodes"])
    assert sorted(_ops(cleaned)) == ["Identity", "Relu", "Transpose"]  # x is an input: Identity stays
    _assert_same(model, cleaned)


# --- fold_affine_into_conv ----------------------------------------------------------------------


def _conv_affine(
    steps: list[tuple[str, np.ndarray, bool]],
    op: str = "Conv",
    bias: bool = True,
    group: int = 1,
    x_shape: tuple = (1, 4, 6, 7),
    conv_is_output: bool = False,
    conv_read_twice: bool = False,
) -> onnx.ModelProto:
    """x -> Conv / ConvTranspose (8 out channels) -> Mul / Add / Sub by constants -> Relu -> y.

    Each step is (op_type, constant, constant_first).
    """
    cin = x_shape[1]
    w = randn(cin, 8 // group, 3, 3) if op == "ConvTranspose" else randn(8, cin // group, 3, 3)
    inits = {"w": w}
    inputs = ["x", "w"]
    if bias:
        inits["b"] = randn(8)
        inputs.append("b")
    nodes = [helper.make_node(op, inputs, ["c"], name="conv", group=group, pads=[1, 1, 1, 1])]
    prev = "c"
    for i, (step, value, first) in enumerate(steps):
        inits[f"k{i}"] = value
        operands = [f"k{i}", prev] if first else [prev, f"k{i}"]
        nodes.append(helper.make_node(step, operands, [f"a{i}"], name=f"affine{i}"))
        prev = f"a{i}"
    nodes.append(helper.make_node("Relu", [prev], ["y"]))
    outputs = ["y"]
    if conv_is_output:
        outputs.append("c")
    if conv_read_twice:
        nodes.append(helper.make_node("Sigmoid", ["c"], ["z"]))
        outputs.append("z")
    return make_model(nodes, [tensor("x", list(x_shape))], outputs, inits)


def _assert_folded(model: onnx.ModelProto, layer: str = "Conv") -> onnx.ModelProto:
    out, changed = _apply("fold_affine_into_conv", model)
    assert changed and _ops(out) == [layer, "Relu"]
    _assert_same(model, out)
    return out


@pytest.mark.parametrize(
    "shape",
    [(1, 8, 1, 1), (8, 1, 1), (), (1,), (1, 1, 1, 1)],
    ids=lambda s: "x".join(map(str, s)) or "scalar",
)
def test_conv_mul_add_folds(shape):
    scale = np.abs(randn(*shape)) + 0.5 if shape else np.float32(1.7)
    shift = randn(*shape) if shape else np.float32(-0.3)
    model = _conv_affine(
        [("Mul", np.asarray(scale, np.float32), False), ("Add", np.asarray(shift, np.float32), False)]
    )
    out = _assert_folded(model)
    assert out.graph.node[0].output[0] == "a1" and out.graph.node[0].name == "conv"


def test_ppocr_style_constant_first_operands_and_no_bias():
    """PP-OCR writes Mul(scale, conv) then Add(.., shift); a bias is created for the shift."""
    model = _conv_affine([("Mul", randn(1), True), ("Add", randn(1), True)], bias=False)
    out = _assert_folded(model)
    assert len(out.graph.node[0].input) == 3


def test_conv_sub_folds_but_constant_minus_conv_does_not():
    _assert_folded(_conv_affine([("Sub", randn(1, 8, 1, 1), False)]))
    _unchanged("fold_affine_into_conv", _conv_affine([("Sub", randn(1, 8, 1, 1), True)]))


def test_grouped_conv_transpose_folds():
    model = _conv_affine(
        [("Mul", randn(1, 8, 1, 1), False), ("Add", randn(8, 1, 1), True)], op="ConvTranspose", group=2
    )
    _assert_folded(model, "ConvTranspose")


@pytest.mark.parametrize(("trans_b", "beta", "c_shape"), [(0, 1.0, None), (1, 0.5, (8,)), (0, 2.0, (3, 8))])
def test_gemm_mul_add_folds(trans_b, beta, c_shape):
    inits = {"w": randn(8, 16) if trans_b else randn(16, 8), "s": randn(8), "t": randn(1, 8)}
    inputs = ["x", "w"]
    if c_shape is not None:
        inits["c"] = randn(*c_shape)
        inputs.append("c")
    nodes = [
        helper.make_node("Gemm", inputs, ["g"], name="fc", transB=trans_b, beta=beta, alpha=0.7),
        helper.make_node("Mul", ["g", "s"], ["m"]),
        helper.make_node("Add", ["t", "m"], ["a"]),
        helper.make_node("Relu", ["a"], ["y"]),
    ]
    model = make_model(nodes, [tensor("x", [3, 16])], ["y"], inits)
    _assert_folded(model, "Gemm")


@pytest.mark.parametrize(
    "model",
    [
        # [8] broadcasts along the last axis (width 8 here), not along the channels
        pytest.param(_conv_affine([("Mul", randn(8), False)], x_shape=(1, 4, 5, 8)), id="per-width constant"),
        pytest.param(_conv_affine([("Add", randn(1, 8, 6, 1), False)]), id="per-row constant"),
        pytest.param(_conv_affine([("Mul", randn(1, 1, 8, 1, 1), False)]), id="constant adds an axis"),
        pytest.param(
            _conv_affine([("Mul", randn(1), False)], conv_is_output=True), id="conv is a graph output"
        ),
        pytest.param(_conv_affine([("Mul", randn(1), False)], conv_read_twice=True), id="conv read twice"),
    ],
)
def test_fold_affine_leaves_others_alone(model):
    _unchanged("fold_affine_into_conv", model)


def test_non_constant_operand_and_mul_before_conv_stay():
    nodes = [
        helper.make_node("Mul", ["x", "s"], ["xs"]),  # before the conv: not foldable in general
        helper.make_node("Add", ["xs", "t"], ["xt"]),
        helper.make_node("Conv", ["xt", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Mul", ["c", "gate"], ["y"]),  # runtime operand
    ]
    model = make_model(
        nodes,
        [tensor("x", [1, 4, 6, 6]), tensor("gate", [1, 8, 1, 1])],
        ["y"],
        {"s": randn(1, 4, 1, 1), "t": randn(1, 4, 1, 1), "w": randn(8, 4, 3, 3)},
    )
    _unchanged("fold_affine_into_conv", model)


def test_shared_weight_is_copied_not_changed():
    inits = {"w": randn(8, 4, 3, 3), "s": randn(1, 8, 1, 1)}
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Mul", ["c1", "s"], ["y1"]),
        helper.make_node("Conv", ["x", "w"], ["y2"], pads=[1, 1, 1, 1]),
    ]
    model = make_model(nodes, [tensor("x", [1, 4, 6, 6])], ["y1", "y2"], inits)
    out, changed = _apply("fold_affine_into_conv", model)
    assert changed and _ops(out) == ["Conv", "Conv"]
    assert out.graph.node[0].input[1] != "w" and out.graph.node[1].input[1] == "w"
    _assert_same(model, out)


# --- real PP-OCRv4 models -----------------------------------------------------------------------


def _rapidocr_model(name: str):
    pytest.importorskip("rapidocr_onnxruntime")
    path = importlib.resources.files("rapidocr_onnxruntime") / "models" / name
    if not path.is_file():
        pytest.skip(f"{name} is not shipped with this rapidocr-onnxruntime")
    return path


def _photo(height: int, width: int, text: bool) -> np.ndarray:
    """A real photo from scikit-image as PaddleOCR feeds it: BGR, (x/255 - 0.5) / 0.5, NCHW."""
    skdata = pytest.importorskip("skimage.data")
    from PIL import Image

    rgb = np.stack([skdata.text()] * 3, axis=-1) if text else skdata.coffee()
    resized = np.asarray(Image.fromarray(rgb).resize((width, height), Image.BILINEAR), np.float32)
    bgr = resized[..., ::-1]
    return ((bgr / 255.0 - 0.5) / 0.5).transpose(2, 0, 1)[None].astype(np.float32)


def _affine_after_conv(model: onnx.ModelProto) -> int:
    """Conv -> Mul / Add by an initializer where the conv output has no other reader."""
    inits, readers, made = initializers(model.graph), consumers(model.graph), producers(model.graph)
    count = 0
    for node in model.graph.node:
        if node.op_type in ("Mul", "Add") and any(i in inits for i in node.input):
            conv = next((made[i] for i in node.input if i in made), None)
            if conv is not None and conv.op_type == "Conv" and len(readers[conv.output[0]]) == 1:
                count += 1
    return count


@pytest.mark.parametrize(
    ("name", "shape", "fewer_than"),
    [
        ("ch_PP-OCRv4_rec_infer.onnx", [1, 3, 48, 320], 360),
        ("ch_PP-OCRv4_det_infer.onnx", [1, 3, 640, 640], 280),
    ],
    ids=["rec", "det"],
)
def test_ppocrv4_structural_passes(name, shape, fewer_than):
    model = load_model(_rapidocr_model(name))
    (input_name,) = [i.name for i in model.graph.input]
    assert input_name == "x"
    model = apply_input_shapes(model, {input_name: shape})
    optimized, records = optimize(model)
    fired = {r.name for r in records if r.changed_iterations}
    assert "fold_affine_into_conv" in fired
    # 28 Conv -> Mul -> Add chains per model fold (BN folding alone leaves them: 403 / 328 nodes)
    assert len(optimized.graph.node) < fewer_than < len(model.graph.node)
    assert _affine_after_conv(optimized) == 0
    assert op_histogram(optimized)["Conv"] == op_histogram(model)["Conv"]
    onnx.checker.check_model(optimized)

    sample = [{input_name: _photo(shape[2], shape[3], text="rec" in name)}]
    ref, new = run(model, sample)[0], run(optimized, sample)[0]
    assert list(ref) == list(new)
    for key in ref:
        max_abs = float(np.abs(ref[key] - new[key]).max())
        assert max_abs <= 1e-4 * float(np.abs(ref[key]).max()), (key, max_abs)



def test_range_inputs_known_as_one_element_become_scalars(tmp_path) -> None:
    """ONNX's own AffineGrid expansion feeds Range [1]-shaped If outputs; once constant folding makes
    those shapes known, onnxruntime refuses to load it unless the inputs are squeezed to scalars."""
    import onnxruntime as ort

    from bench.conformance.cases import collect
    from pulsar.frontend.pass_manager import optimize
    from pulsar.frontend.passes import DEFAULT_PASSES

    [case], _ = collect(["test_affine_grid_2d_expanded"])
    without = [p for p in DEFAULT_PASSES if p != "scalar_range_inputs"]
    folded, _ = optimize(case.model, without, check=False)
    with pytest.raises(Exception, match="Range"):
        ort.InferenceSession(folded.SerializeToString())
    fixed, _ = optimize(case.model, check=False)
    assert any(n.op_type == "Squeeze" and n.output[0].endswith("_scalar") for n in fixed.graph.node)
    got = ort.InferenceSession(fixed.SerializeToString()).run(None, case.inputs)[0]
    np.testing.assert_allclose(got, case.expected[0], rtol=1e-5, atol=1e-6)
