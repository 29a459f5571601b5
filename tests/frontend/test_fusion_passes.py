"""Pattern fusions (LayerNorm, GELU, HardSwish, HardSigmoid, SiLU, Softmax) against onnxruntime."""

from __future__ import annotations

import importlib.resources
import io
import math
from collections import Counter

import numpy as np
import onnx
import pytest
from frontend_graphs import make_model, randn, tensor
from onnx import helper, numpy_helper

from pulsar.frontend.check import compare_models, random_samples, run
from pulsar.frontend.loader import apply_input_shapes, load_model
from pulsar.frontend.pass_manager import op_histogram, optimize
from pulsar.frontend.passes import DEFAULT_PASSES, PASSES

FUSIONS = ["fuse_layernorm", "fuse_gelu", "fuse_silu", "fuse_hardswish", "fuse_hardsigmoid", "fuse_softmax"]
SHAPE = [2, 5, 16]


def _apply(name: str, model: onnx.ModelProto) -> tuple[onnx.ModelProto, bool]:
    """One pass on a copy, then dead-node cleanup; the result must pass the ONNX checker."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    changed = PASSES[name](copy)
    PASSES["eliminate_dead_nodes"](copy)
    onnx.checker.check_model(copy)
    return copy, changed


def _ops(model: onnx.ModelProto) -> Counter:
    return Counter(n.op_type for n in model.graph.node)


def _assert_same(a: onnx.ModelProto, b: onnx.ModelProto, rtol: float = 1e-5) -> None:
    samples = random_samples(a, count=2, seed=7)
    for sample in samples:  # wider than N(0, 1): reach the saturated parts of the activations
        for k in sample:
            sample[k] = sample[k] * 4
    for row in compare_models(a, b, samples):
        assert row["rel_diff"] <= rtol, row


def _fused(name: str, model: onnx.ModelProto, op: str, gone: set[str], rtol: float = 1e-5) -> onnx.ModelProto:
    fused, changed = _apply(name, model)
    assert changed
    ops = _ops(fused)
    assert ops[op] == _ops(model)[op] + 1, ops
    assert not gone & set(ops), ops
    _assert_same(model, fused, rtol)
    again, changed_again = _apply(name, fused)  # a fixed point: nothing left to fuse
    assert not changed_again and _ops(again) == ops
    return fused


def _untouched(name: str, model: onnx.ModelProto) -> None:
    fused, changed = _apply(name, model)
    assert not changed
    assert _ops(fused) == _ops(model)


def _model(nodes, inits, opset: int = 17, shape=SHAPE, outputs=("y",)) -> onnx.ModelProto:
    inits = {k: np.asarray(v, np.float32) if isinstance(v, float) else v for k, v in inits.items()}
    return make_model(
        nodes, [tensor("x", shape)], [tensor(o, ["d0", "d1", "d2"]) for o in outputs], inits, opset=opset
    )


def _node(op: str, inputs: list[str], output: str, **kw) -> onnx.NodeProto:
    return helper.make_node(op, inputs, [output], name=f"blk/{output}", **kw)


# --- LayerNorm ----------------------------------------------------------------------------------


def _layernorm(
    square: str = "pow",
    divide: str = "div",
    twice: bool = False,
    gamma=True,
    beta=True,
    axes=(-1,),
    opset: int = 17,
    shape=SHAPE,
    extra_output: str | None = None,
) -> onnx.ModelProto:
    """(x - mean) / sqrt(mean((x - mean)^2) + eps) [* gamma] [+ beta], spelt as the exporters do."""
    inits: dict = {"eps": 1e-5, "two": 2.0, "one": 1.0}
    if opset >= 18:
        inits["axes"] = np.array(axes, np.int64)
        reduce = {"inputs": ["axes"], "kw": {}}
    else:
        reduce = {"inputs": [], "kw": {"axes": list(axes)}}
    nodes = [
        _node("ReduceMean", ["x", *reduce["inputs"]], "m", **reduce["kw"]),
        _node("Sub", ["x", "m"], "d"),
    ]
    num = "d"
    if twice:
        nodes.append(_node("Sub", ["x", "m"], "d2"))
        num = "d2"
    nodes.append(_node("Pow", ["d", "two"], "sq") if square == "pow" else _node("Mul", ["d", "d"], "sq"))
    nodes += [
        _node("ReduceMean", ["sq", *reduce["inputs"]], "v", **reduce["kw"]),
        _node("Add", ["eps", "v"], "ve"),
        _node("Sqrt", ["ve"], "s"),
    ]
    if divide == "div":
        nodes.append(_node("Div", [num, "s"], "n"))
    else:
        nodes.append(
            _node("Reciprocal", ["s"], "r") if divide == "recip" else _node("Div", ["one", "s"], "r")
        )
        nodes.append(_node("Mul", ["r", num], "n"))
    out = "n"
    if gamma is not None and gamma is not False:
        inits["gamma"] = (
            gamma
            if isinstance(gamma, np.ndarray)
            else np.random.default_rng(0).uniform(0.5, 2, shape[-1]).astype(np.float32)
        )
        nodes.append(_node("Mul", ["gamma", out], "g"))
        out = "g"
    if beta:
        inits["beta"] = randn(shape[-1])
        nodes.append(_node("Add", [out, "beta"], "b"))
        out = "b"
    nodes.append(_node("Identity", [out], "y"))
    outputs = ("y", extra_output) if extra_output else ("y",)
    return _model(nodes, inits, opset, shape, outputs)


LN_OPS = {"ReduceMean", "Sub", "Pow", "Sqrt", "Div", "Reciprocal"}


@pytest.mark.parametrize(
    "kw",
    [
        {},  # Paddle / torch: Pow, Div, gamma and beta
        {"square": "mul", "divide": "recip", "gamma": False, "beta": False},  # TF: Mul by Reciprocal
        {"twice": True, "beta": False},  # x - mean computed twice
        {"divide": "one_div", "gamma": False},  # 1 / sqrt as a Div
        {"opset": 18, "axes": (2,)},  # axes as an input, positive
        {"axes": (1, 2)},  # two trailing axes: gamma (16,) broadcast over (5, 16)
    ],
)
def test_layernorm_variants(kw):
    model = _layernorm(**kw)
    fused = _fused("fuse_layernorm", model, "LayerNormalization", LN_OPS)
    (ln,) = [n for n in fused.graph.node if n.op_type == "LayerNormalization"]
    inits = {t.name: numpy_helper.to_array(t) for t in fused.graph.initializer}
    axes = kw.get("axes", (-1,))
    assert helper.get_attribute_value(ln.attribute[0]) in (-len(axes), 3 - len(axes))
    assert inits[ln.input[1]].shape == tuple(SHAPE[-len(axes) :])
    if not kw.get("gamma", True):
        assert np.all(inits[ln.input[1]] == 1)
    if not kw.get("beta", True):
        assert np.all(inits[ln.input[2]] == 0)
    assert ln.name == "blk/LayerNormalization"
    assert "Mul" not in _ops(fused) and "Add" not in _ops(fused)


def _keras_layernorm(gamma: bool = True, beta: bool = True) -> onnx.ModelProto:
    """tf.nn.batch_normalization as tf2onnx writes it: x * k + (beta - mean * k), k = gamma / std."""
    inits: dict = {"eps": 1e-3, "gamma": np.linspace(0.5, 2, 16, dtype=np.float32), "beta": randn(16)}
    nodes = [
        _node("ReduceMean", ["x"], "m", axes=[-1]),
        _node("Sub", ["x", "m"], "d"),
        _node("Mul", ["d", "d"], "sq"),
        _node("ReduceMean", ["sq"], "v", axes=[-1]),
        _node("Add", ["v", "eps"], "ve"),
        _node("Sqrt", ["ve"], "s"),
        _node("Reciprocal", ["s"], "r"),
    ]
    k = "r"
    if gamma:
        nodes.append(_node("Mul", ["r", "gamma"], "k"))
        k = "k"
    nodes += [_node("Mul", ["x", k], "xk"), _node("Mul", [k, "m"], "mk")]
    nodes.append(_node("Sub", ["beta", "mk"], "c") if beta else _node("Neg", ["mk"], "c"))
    nodes.append(_node("Add", ["c", "xk"], "y"))
    return _model(nodes, inits)


@pytest.mark.parametrize(("gamma", "beta"), [(True, True), (False, False)])
def test_layernorm_keras_form(gamma, beta):
    model = _keras_layernorm(gamma, beta)
    fused = _fused("fuse_layernorm", model, "LayerNormalization", LN_OPS | {"Mul", "Add", "Neg"})
    (ln,) = fused.graph.node
    assert math.isclose(helper.get_attribute_value(ln.attribute[1]), 1e-3, rel_tol=1e-6)


def test_layernorm_keeps_gamma_that_varies_over_other_axes():
    """A (5, 1) gamma scales rows, not features: the Mul stays after the fused node."""
    gamma = np.linspace(0.5, 2, 5, dtype=np.float32).reshape(5, 1)
    fused = _fused("fuse_layernorm", _layernorm(gamma=gamma, beta=False), "LayerNormalization", LN_OPS)
    assert _ops(fused)["Mul"] == 1


@pytest.mark.parametrize(
    "kw",
    [
        {"axes": (1,)},  # not the last axis
        {"extra_output": "d"},  # x - mean is also a graph output
        {"extra_output": "s"},  # so is the standard deviation
    ],
)
def test_layernorm_look_alikes_untouched(kw):
    _untouched("fuse_layernorm", _layernorm(**kw))


def test_layernorm_with_outside_reader_untouched():
    model = _layernorm()
    model.graph.node.append(_node("Neg", ["v"], "z"))  # the variance is read outside the pattern
    model.graph.output.append(tensor("z", ["d0", "d1", "d2"]))
    _untouched("fuse_layernorm", model)


# --- GELU ---------------------------------------------------------------------------------------


def _gelu(kind: str, scale: float | None = None, extra_output: str | None = None) -> onnx.ModelProto:
    c = {"half": 0.5, "one": 1.0, "two": 2.0, "three": 3.0, "sqrt2": 1.4142135, "rsqrt2": 0.70710677,
         "k": 0.7978845608, "cubic": 0.044715}  # fmt: skip
    if scale is not None:
        c["sqrt2" if kind.startswith("erf") else "cubic"] = scale
    erf_div = [_node("Div", ["x", "sqrt2"], "t"), _node("Erf", ["t"], "e"), _node("Add", ["e", "one"], "a")]
    tanh_tail = [_node("Tanh", ["u"], "e"), _node("Add", ["one", "e"], "a"), _node("Mul", ["x", "a"], "p"),
                 _node("Mul", ["half", "p"], "y")]  # fmt: skip
    forms = {
        # torch: Div, Erf, Add, Mul by x, then Mul by 0.5
        "erf_torch": [*erf_div, _node("Mul", ["x", "a"], "p"), _node("Mul", ["p", "half"], "y")],
        # BERT: x * 0.5 first, 1/sqrt(2) as a Mul
        "erf_half_first": [
            _node("Mul", ["rsqrt2", "x"], "t"), _node("Erf", ["t"], "e"), _node("Add", ["one", "e"], "a"),
            _node("Mul", ["x", "half"], "h"), _node("Mul", ["h", "a"], "y"),
        ],
        # 0.5 on the (1 + erf) side
        "erf_half_on_gate": [*erf_div, _node("Mul", ["a", "half"], "h"), _node("Mul", ["h", "x"], "y")],
        # / 2 instead of * 0.5
        "erf_div_two": [*erf_div, _node("Mul", ["a", "x"], "p"), _node("Div", ["p", "two"], "y")],
        # torch approximate="tanh": x * x * x
        "tanh_torch": [
            _node("Mul", ["x", "x"], "x2"), _node("Mul", ["x", "x2"], "x3"), _node("Mul", ["cubic", "x3"], "c3"),
            _node("Add", ["x", "c3"], "i"), _node("Mul", ["k", "i"], "u"), *tanh_tail,
        ],
        # HF gelu_new: Pow(x, 3)
        "tanh_pow": [
            _node("Pow", ["x", "three"], "x3"), _node("Mul", ["x3", "cubic"], "c3"),
            _node("Add", ["c3", "x"], "i"), _node("Mul", ["i", "k"], "u"), *tanh_tail,
        ],
        # Megatron: k * x * (1 + 0.044715 * x * x)
        "tanh_factored": [
            _node("Mul", ["k", "x"], "kx"), _node("Mul", ["cubic", "x"], "cx"), _node("Mul", ["cx", "x"], "cxx"),
            _node("Add", ["one", "cxx"], "i"), _node("Mul", ["kx", "i"], "u"), *tanh_tail,
        ],
    }  # fmt: skip
    nodes = forms[kind]
    outputs = ("y", extra_output) if extra_output else ("y",)
    return _model(nodes, c, outputs=outputs)


@pytest.mark.parametrize(
    "kind",
    [
        "erf_torch",
        "erf_half_first",
        "erf_half_on_gate",
        "erf_div_two",
        "tanh_torch",
        "tanh_pow",
        "tanh_factored",
    ],
)
def test_gelu_variants(kind):
    op = "Gelu" if kind.startswith("erf") else "FastGelu"
    fused = _fused("fuse_gelu", _gelu(kind), op, {"Erf", "Tanh", "Mul", "Add", "Div", "Pow"})
    (node,) = fused.graph.node
    assert node.domain == "com.microsoft" and list(node.input) == ["x"] and list(node.output) == ["y"]
    assert any(o.domain == "com.microsoft" and o.version == 1 for o in fused.opset_import)
    # onnx shape inference does not know com.microsoft: the pass annotates the output itself
    (vi,) = [v for v in fused.graph.value_info if v.name == "y"]
    assert vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert [d.dim_value for d in vi.type.tensor_type.shape.dim] == SHAPE


@pytest.mark.parametrize(("kind", "scale"), [("erf_torch", 1.4142), ("tanh_torch", 0.0447)])
def test_gelu_accepts_constants_rounded_to_1e_3(kind, scale):
    """Hand-written models round sqrt(2) or 0.044715; the fused op is within the pass check's 1e-4."""
    _fused(
        "fuse_gelu",
        _gelu(kind, scale),
        "Gelu" if kind.startswith("erf") else "FastGelu",
        {"Erf", "Tanh"},
        1e-4,
    )


@pytest.mark.parametrize(
    ("kind", "scale", "extra"),
    [
        ("erf_torch", 1.5, None),  # not sqrt(2)
        ("tanh_torch", 0.05, None),  # not 0.044715
        ("erf_torch", None, "e"),  # the Erf output is also a graph output
        ("tanh_pow", None, "p"),  # an inner product is also a graph output
    ],
)
def test_gelu_look_alikes_untouched(kind, scale, extra):
    _untouched("fuse_gelu", _gelu(kind, scale, extra))


def test_gelu_with_outside_reader_untouched():
    model = _gelu("erf_half_first")
    model.graph.node.append(_node("Neg", ["h"], "z"))  # x * 0.5 read outside the pattern
    model.graph.output.append(tensor("z", ["d0", "d1", "d2"]))
    _untouched("fuse_gelu", model)


# --- HardSwish / HardSigmoid --------------------------------------------------------------------


def _clip(inp: str, out: str, lo: float, hi: float, attrs: bool) -> onnx.NodeProto:
    if attrs:  # Clip-6 (opset < 11) has its bounds as attributes
        return _node("Clip", [inp], out, min=lo, max=hi)
    return _node("Clip", [inp, f"{out}_lo", f"{out}_hi"], out)


def _hard(
    kind: str, hi: float = 6.0, attrs: bool = False, extra_output: str | None = None
) -> onnx.ModelProto:
    c = {"three": 3.0, "six": 6.0, "sixth": 1.0 / 6.0, "a": 0.2, "b": 0.5}
    if not attrs:
        c.update({"r6_lo": 0.0, "r6_hi": hi, "u_lo": 0.0, "u_hi": 1.0})
    relu6 = [_node("Add", ["x", "three"], "p3"), _clip("p3", "r6", 0.0, hi, attrs)]
    forms = {
        # Paddle hardswish: x * Relu6(x + 3) / 6
        "swish_paddle": [*relu6, _node("Mul", ["x", "r6"], "m"), _node("Div", ["m", "six"], "y")],
        "swish_div_first": [*relu6, _node("Div", ["r6", "six"], "g"), _node("Mul", ["g", "x"], "y")],
        "swish_sixth": [*relu6, _node("Mul", ["sixth", "r6"], "g"), _node("Mul", ["x", "g"], "y")],
        "swish_hardsigmoid": [_node("HardSigmoid", ["x"], "g", alpha=1.0 / 6.0, beta=0.5), _node("Mul", ["g", "x"], "y")],
        "swish_other": [*relu6, _node("Mul", ["x", "r6"], "m"), _node("Mul", ["m", "x"], "y")],  # x^2 * ...
        # Paddle hardsigmoid: Clip(x * a + b, 0, 1)
        "sigmoid_affine": [_node("Mul", ["x", "a"], "xa"), _node("Add", ["xa", "b"], "u"), _clip("u", "y", 0.0, 1.0, attrs)],
        "sigmoid_relu6": [*relu6, _node("Div", ["r6", "six"], "y")],
        "sigmoid_bare": [_clip("x", "y", 0.0, 1.0, attrs)],
    }  # fmt: skip
    nodes = forms[kind]
    if kind == "sigmoid_affine" and not attrs:
        nodes[-1].input[1:] = ["u_lo", "u_hi"]
    if kind == "sigmoid_bare" and not attrs:
        nodes[-1].input[1:] = ["u_lo", "u_hi"]
    outputs = ("y", extra_output) if extra_output else ("y",)
    return _model(nodes, c, opset=10 if attrs else 17, outputs=outputs)


@pytest.mark.parametrize("kind", ["swish_paddle", "swish_div_first", "swish_sixth", "swish_hardsigmoid"])
def test_hardswish_variants(kind):
    fused = _fused("fuse_hardswish", _hard(kind), "HardSwish", {"Clip", "Mul", "Div", "Add", "HardSigmoid"})
    assert [(n.op_type, list(n.input), list(n.output)) for n in fused.graph.node] == [
        ("HardSwish", ["x"], ["y"])
    ]


@pytest.mark.parametrize(
    ("kind", "hi", "extra"),
    [
        ("swish_paddle", 5.0, None),  # Clip(0, 5): not Relu6
        ("swish_other", 6.0, None),  # x * x * Relu6(x + 3)
        ("swish_paddle", 6.0, "r6"),  # the Relu6 output is also a graph output
    ],
)
def test_hardswish_look_alikes_untouched(kind, hi, extra):
    _untouched("fuse_hardswish", _hard(kind, hi, extra_output=extra))


def test_hardswish_scale_must_be_exact():
    """1/6 written as 0.1667 would move the output by 2e-4: more than the pass check allows."""
    model = _hard("swish_sixth")
    names = [t.name for t in model.graph.initializer]
    model.graph.initializer[names.index("sixth")].CopyFrom(
        numpy_helper.from_array(np.array(0.1667, np.float32), "sixth")
    )
    _untouched("fuse_hardswish", model)


@pytest.mark.parametrize(
    ("kind", "attrs", "alpha", "beta"),
    [
        ("sigmoid_affine", False, 0.2, 0.5),
        ("sigmoid_affine", True, 0.2, 0.5),  # Clip bounds as attributes (opset 10)
        ("sigmoid_relu6", False, 1.0 / 6.0, 0.5),
    ],
)
def test_hardsigmoid_variants(kind, attrs, alpha, beta):
    fused = _fused("fuse_hardsigmoid", _hard(kind, attrs=attrs), "HardSigmoid", {"Clip", "Mul", "Add", "Div"})
    (node,) = fused.graph.node
    values = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert math.isclose(values["alpha"], alpha, rel_tol=1e-6) and math.isclose(
        values["beta"], beta, rel_tol=1e-6
    )


def test_hardsigmoid_leaves_plain_clip_and_other_ranges():
    _untouched("fuse_hardsigmoid", _hard("sigmoid_bare"))  # Clip(x, 0, 1): a Clip is cheaper
    model = _hard("sigmoid_affine")
    model.graph.initializer[[t.name for t in model.graph.initializer].index("u_hi")].CopyFrom(
        numpy_helper.from_array(np.array(2.0, np.float32), "u_hi")
    )
    _untouched("fuse_hardsigmoid", model)  # saturates at 2, not 1


def test_hardswish_then_hardsigmoid_in_the_default_order():
    """Div-first hardswish: the HardSigmoid pass alone would take the gate, the default order fuses all."""
    model = _hard("swish_div_first")
    optimized, _ = optimize(model, ["fuse_hardswish", "fuse_hardsigmoid", "eliminate_dead_nodes"])
    assert [n.op_type for n in optimized.graph.node] == ["HardSwish"]
    step, _ = optimize(model, ["fuse_hardsigmoid", "fuse_hardswish", "eliminate_dead_nodes"])
    assert [n.op_type for n in step.graph.node] == ["HardSwish"]  # via HardSigmoid, one more iteration


# --- SiLU ---------------------------------------------------------------------------------------


def _silu(kind: str, beta: float = 1.0) -> onnx.ModelProto:
    c = {"beta": beta, "one": 1.0, "minus": -1.0}
    forms = {
        "paddle": [_node("Mul", ["x", "beta"], "u"), _node("Sigmoid", ["u"], "s"), _node("Mul", ["x", "s"], "y")],
        "exp_div": [_node("Neg", ["x"], "n"), _node("Exp", ["n"], "e"), _node("Add", ["one", "e"], "d"),
                    _node("Div", ["x", "d"], "y")],
        "exp_reciprocal": [_node("Mul", ["x", "minus"], "n"), _node("Exp", ["n"], "e"), _node("Add", ["e", "one"], "d"),
                           _node("Reciprocal", ["d"], "r"), _node("Mul", ["r", "x"], "y")],
        "exp_one_div": [_node("Neg", ["x"], "n"), _node("Exp", ["n"], "e"), _node("Add", ["e", "one"], "d"),
                        _node("Div", ["one", "d"], "r"), _node("Mul", ["x", "r"], "y")],
    }  # fmt: skip
    return _model(forms[kind], c)


@pytest.mark.parametrize("kind", ["exp_div", "exp_reciprocal", "exp_one_div"])
def test_silu_from_exp_becomes_sigmoid_times_x(kind):
    fused = _fused("fuse_silu", _silu(kind), "Sigmoid", {"Exp", "Neg", "Div", "Reciprocal", "Add"})
    sigmoid, mul = fused.graph.node
    assert (sigmoid.op_type, list(sigmoid.input)) == ("Sigmoid", ["x"])
    assert mul.op_type == "Mul" and set(mul.input) == {"x", sigmoid.output[0]} and list(mul.output) == ["y"]


def test_silu_paddle_swish_loses_its_multiply_by_one():
    model = _silu("paddle")
    fused, changed = _apply("fuse_silu", model)
    assert changed
    _assert_same(model, fused)
    assert [(n.op_type, sorted(n.input)) for n in fused.graph.node] == [
        ("Sigmoid", ["x"]),
        ("Mul", ["s", "x"]),
    ]
    assert not _apply("fuse_silu", fused)[1]


def test_silu_with_other_beta_untouched():
    _untouched("fuse_silu", _silu("paddle", beta=1.702))  # x * sigmoid(1.702 x) is another function


# --- Softmax ------------------------------------------------------------------------------------


def _softmax(
    with_max: bool = True,
    reciprocal: bool = False,
    max_axis: int = -1,
    sum_axis: int = -1,
    extra: str | None = None,
) -> onnx.ModelProto:
    c = {"sum_axes": np.array([sum_axis], np.int64)}
    nodes = []
    src = "x"
    if with_max:
        nodes += [_node("ReduceMax", ["x"], "mx", axes=[max_axis]), _node("Sub", ["x", "mx"], "z")]
        src = "z"
    nodes += [_node("Exp", [src], "e"), _node("ReduceSum", ["e", "sum_axes"], "s")]
    if reciprocal:
        nodes += [_node("Reciprocal", ["s"], "r"), _node("Mul", ["e", "r"], "y")]
    else:
        nodes.append(_node("Div", ["e", "s"], "y"))
    outputs = ("y", extra) if extra else ("y",)
    return _model(nodes, c, outputs=outputs)


@pytest.mark.parametrize(
    ("kw", "axis"),
    [
        ({}, 2),
        ({"with_max": False}, 2),
        ({"reciprocal": True}, 2),
        ({"max_axis": 1, "sum_axis": -2}, 1),
    ],
)
def test_softmax_variants(kw, axis):
    fused = _fused("fuse_softmax", _softmax(**kw), "Softmax", {"Exp", "ReduceMax", "ReduceSum", "Div", "Sub"})
    (node,) = fused.graph.node
    assert list(node.input) == ["x"] and helper.get_attribute_value(node.attribute[0]) == axis


@pytest.mark.parametrize("kw", [{"max_axis": 1, "sum_axis": 2}, {"extra": "e"}, {"extra": "s"}])
def test_softmax_look_alikes_untouched(kw):
    _untouched("fuse_softmax", _softmax(**kw))


def test_softmax_keeps_a_max_read_elsewhere():
    """The max is a graph output: Softmax of x - max is still exact, the subtraction stays."""
    model = _softmax(extra="mx")
    fused, changed = _apply("fuse_softmax", model)
    assert changed
    assert [n.op_type for n in fused.graph.node] == ["ReduceMax", "Sub", "Softmax"]
    _assert_same(model, fused)


# --- registration and real models -----------------------------------------------------------------


def test_fusions_registered_after_folding():
    for name in FUSIONS:
        assert name in PASSES and name in DEFAULT_PASSES
        assert DEFAULT_PASSES.index(name) > DEFAULT_PASSES.index("fold_batchnorm")
    assert DEFAULT_PASSES.index("fuse_hardswish") < DEFAULT_PASSES.index("fuse_hardsigmoid")


def test_fusions_skip_float16():
    """onnxruntime's fused kernels would round differently from the fp16 chain: leave it alone."""
    model = _gelu("erf_torch")
    model.graph.input[0].type.tensor_type.elem_type = onnx.TensorProto.FLOAT16
    for t in model.graph.initializer:
        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float16), t.name))
    model.graph.output[0].type.tensor_type.elem_type = onnx.TensorProto.FLOAT16
    _untouched("fuse_gelu", model)


def test_torch_export_fuses_and_matches_torch():
    torch = pytest.importorskip("torch")
    nn = torch.nn

    class HandLayerNorm(nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.rand(n) + 0.5)
            self.bias = nn.Parameter(torch.randn(n))

        def forward(self, x):
            d = x - x.mean(-1, keepdim=True)
            return d / torch.sqrt(d.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight + self.bias

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln, self.hand_ln, self.fc = nn.LayerNorm(16), HandLayerNorm(16), nn.Linear(16, 16)
            self.gelu, self.gelu_tanh = nn.GELU(), nn.GELU(approximate="tanh")
            self.hardswish, self.silu = nn.Hardswish(), nn.SiLU()

        def forward(self, x):
            x = self.ln(x)
            a = self.gelu(self.fc(x))
            b = self.gelu_tanh(self.hand_ln(x))
            return self.silu(self.hardswish(a + b)) + torch.softmax(a, -1)

    torch.manual_seed(0)
    net = Net().eval()
    x = torch.randn(2, 8, 16) * 2
    buffer = io.BytesIO()
    torch.onnx.export(net, (x,), buffer, opset_version=17, dynamo=False, input_names=["x"])
    model = onnx.load_from_string(buffer.getvalue())
    assert "Erf" in op_histogram(model) and "Tanh" in op_histogram(model)

    optimized, records = optimize(model)
    ops = op_histogram(optimized)
    assert ops["LayerNormalization"] == 2 and ops["Gelu"] == 1 and ops["FastGelu"] == 1
    assert ops["HardSwish"] == 1 and ops["Sigmoid"] == 1
    assert not {"Erf", "Tanh", "Pow", "Sqrt", "ReduceMean", "Div"} & set(ops)
    assert {r.name for r in records if r.changed_iterations} >= {"fuse_layernorm", "fuse_gelu"}
    (got,) = run(optimized, [{"x": x.numpy()}])[0].values()
    want = net(x).detach().numpy()
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_ppocrv4_recognizer_fusions():
    pytest.importorskip("rapidocr_onnxruntime")
    path = importlib.resources.files("rapidocr_onnxruntime") / "models" / "ch_PP-OCRv4_rec_infer.onnx"
    if not path.is_file():
        pytest.skip("ch_PP-OCRv4_rec_infer.onnx is not shipped with this rapidocr-onnxruntime")
    model = apply_input_shapes(load_model(path), {"x": [1, 3, 48, 320]})
    before = op_histogram(model)
    assert "LayerNormalization" not in before and before["Pow"] == 5 and before["Sqrt"] == 5

    optimized, records = optimize(model)
    after = op_histogram(optimized)
    changed = {r.name for r in records if r.changed_iterations}
    assert {"fuse_layernorm", "fuse_hardswish", "fuse_silu"} <= changed
    assert after["LayerNormalization"] == 5 and after["HardSwish"] == 28
    assert not {"Pow", "Sqrt", "ReduceMean", "Clip", "Div"} & set(after)
    assert after["Sigmoid"] == 7  # swish: the Paddle multiply by 1.0 is gone, x * Sigmoid(x) stays
    assert sum(after.values()) < sum(before.values())
    for row in compare_models(model, optimized, random_samples(model, count=1, seed=3)):
        assert row["rel_diff"] <= 1e-4, row
