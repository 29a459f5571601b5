"""NpuProgram: an integer body mixing pulsar.int ops and data movement, against composed references."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from pulsar.core.fixedpoint import quantize_multiplier
from pulsar.errors import PulsarError
from pulsar.runtime.npu_sim import NpuProgram, body_ops, supported_ops, unsupported_ops
from tests.runtime.kernels import intref

RNG = np.random.default_rng(31)
INT = "pulsar.int"


def weights() -> dict[str, np.ndarray]:
    conv_m, conv_n = quantize_multiplier(RNG.uniform(2e-3, 6e-3, size=4), 1 << 20)
    mm_m, mm_n = quantize_multiplier(RNG.uniform(1e-3, 3e-3, size=6), 1 << 20)
    u = np.arange(0, 65537, 256)
    lut = np.clip(np.round(255 / (1 + np.exp(-(u - 32768) * (8 / 32768)))), 0, 255).astype(np.int32)
    d = np.arange(256)
    ln_m, ln_n = quantize_multiplier(np.full(6, (1.5 / 127) * np.sqrt(6) / ((4 / 127) * 2**12)), 127 << 12)
    return {
        "W/q": RNG.integers(-127, 128, size=(4, 3, 3, 3)).astype(np.int8),
        "B/q": RNG.integers(-2000, 2000, size=4).astype(np.int32),
        "conv/M": conv_m, "conv/N": conv_n,
        "Wm/q": RNG.integers(-127, 128, size=(4, 6)).astype(np.int8),
        "Bm/q": RNG.integers(-500, 500, size=6).astype(np.int32),
        "mm/M": mm_m, "mm/N": mm_n,
        "lut/table": lut,
        "split/sizes": np.array([2, 4], np.int64),
        "exp/table": np.round(np.exp(-d * 0.05) * 2**20).astype(np.int32),
        "G/q": RNG.integers(40, 127, size=6).astype(np.int8),
        "Beta/q": RNG.integers(-20, 20, size=6).astype(np.int64),
        "ln/M": ln_m, "ln/N": ln_n,
    }


CONV = {"x_zp": 128, "pads": [1, 1, 1, 1], **intref.out_attrs(np.uint8, 0)}  # Relu fused: out_min = zp = 0
MM = {"a_zp": 0, "b_zp": 0, "trans_b": 0, **intref.out_attrs(np.int8, 3)}
RQ = {"x_zp": 3, "M": 181, "N": 0, **intref.out_attrs(np.int16)}
LUT = {"step_bits": 8, **intref.out_attrs(np.uint8)}
ADD = {"a_zp": 0, "b_zp": -5, "Ma": 1 << 14, "Mb": 3 << 13, "N": 15, **intref.out_attrs(np.uint8, 20)}
SM = {"axis": -1, "step_bits": 0, "Q": round(2**16 * 255), "P": 16, **intref.out_attrs(np.uint8)}
LN = {"axis": -1, "x_zp": 20, "eps_q": 50, "F": 12, **intref.out_attrs(np.int8)}

SHAPES = {  # tensor -> (dtype, shape)
    "x/q": (np.uint8, [1, 3, 8, 8]), "s/q": (np.int8, [1, 16, 6]),
    "c/q": (np.uint8, [1, 4, 8, 8]), "p/q": (np.uint8, [1, 4, 4, 4]), "r/q": (np.uint8, [1, 4, 16]),
    "t/q": (np.uint8, [1, 16, 4]), "m/q": (np.int8, [1, 16, 6]), "m16/q": (np.int16, [1, 16, 6]),
    "l/q": (np.uint8, [1, 16, 6]), "a/q": (np.uint8, [1, 16, 6]), "a0/q": (np.uint8, [1, 16, 2]),
    "a1/q": (np.uint8, [1, 16, 4]), "cat/q": (np.uint8, [1, 16, 6]), "sm/q": (np.uint8, [1, 16, 6]),
    "ln/q": (np.int8, [1, 16, 6]),
}


def vi(name: str, shapes: dict | None = None) -> object:
    dtype, shape = (shapes or SHAPES)[name]
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), shape)


def body(consts: dict[str, np.ndarray], as_initializers: bool = True, shapes: dict | None = None,
         **overrides) -> object:
    n = helper.make_node
    nodes = [
        n("QConv", ["x/q", "W/q", "B/q", "conv/M", "conv/N"], ["c/q"], "conv", domain=INT, **CONV),
        n("MaxPool", ["c/q"], ["p/q"], "pool", kernel_shape=[2, 2], strides=[2, 2]),
        n("Constant", [], ["shape"], "shape_const", value=numpy_helper.from_array(np.array([1, 4, 16], np.int64))),
        n("Reshape", ["p/q", "shape"], ["r/q"], "reshape"),
        n("Transpose", ["r/q"], ["t/q"], "transpose", perm=[0, 2, 1]),
        n("QMatMul", ["t/q", "Wm/q", "Bm/q", "mm/M", "mm/N"], ["m/q"], "matmul", domain=INT, **MM),
        n("Requantize", ["m/q"], ["m16/q"], "to16", domain=INT, **RQ),
        n("QLut", ["m16/q", "lut/table"], ["l/q"], "sigmoid", domain=INT, **LUT),
        n("QAdd", ["l/q", "s/q"], ["a/q"], "add", domain=INT, **ADD),
        n("Split", ["a/q", "split/sizes"], ["a0/q", "a1/q"], "split", axis=2),
        n("Concat", ["a1/q", "a0/q"], ["cat/q"], "concat", axis=2),
        n("QSoftmax", ["cat/q", "exp/table"], ["sm/q"], "softmax", domain=INT, **SM),
        n("QLayerNorm", ["cat/q", "G/q", "Beta/q", "ln/M", "ln/N"], ["ln/q"], "layernorm", domain=INT, **LN),
    ]
    for name, node in overrides.items():
        nodes[[x.name for x in nodes].index(name)] = node
    inits = [numpy_helper.from_array(v, k) for k, v in consts.items()] if as_initializers else []
    shapes = {**SHAPES, **(shapes or {})}
    return helper.make_graph(nodes, "npu_0", [vi("x/q"), vi("s/q")], [vi("sm/q"), vi("ln/q")], initializer=inits,
                             value_info=[vi(k, shapes) for k in shapes if k not in ("x/q", "s/q", "sm/q", "ln/q")])


def reference(feeds: dict[str, np.ndarray], w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    t = {}
    t["c/q"] = intref.qconv(feeds["x/q"], w["W/q"], w["B/q"], w["conv/M"], w["conv/N"], CONV)
    t["p/q"] = t["c/q"].reshape(1, 4, 4, 2, 4, 2).max(axis=(3, 5))
    t["t/q"] = t["p/q"].reshape(1, 4, 16).transpose(0, 2, 1)
    t["m/q"] = intref.qmatmul(t["t/q"], w["Wm/q"], w["Bm/q"], w["mm/M"], w["mm/N"], MM)
    t["m16/q"] = intref.requantize(t["m/q"], RQ)
    t["l/q"] = intref.qlut(t["m16/q"], w["lut/table"], LUT)
    t["a/q"] = intref.qadd(t["l/q"], feeds["s/q"], ADD)
    t["cat/q"] = np.concatenate([t["a/q"][..., 2:], t["a/q"][..., :2]], axis=2)
    t["sm/q"] = intref.qsoftmax(t["cat/q"], w["exp/table"], SM)
    t["ln/q"] = intref.qlayernorm(t["cat/q"], w["G/q"], w["Beta/q"], w["ln/M"], w["ln/N"], LN)
    return t


@pytest.fixture(scope="module")
def case():
    w = weights()
    feeds = {"x/q": RNG.integers(0, 256, size=(1, 3, 8, 8)).astype(np.uint8),
             "s/q": RNG.integers(-128, 128, size=(1, 16, 6)).astype(np.int8)}
    return w, feeds, reference(feeds, w)


def test_program_matches_composed_references(case):
    w, feeds, ref = case
    program = NpuProgram(body(w))
    out = program.run(feeds)
    assert sorted(out) == ["ln/q", "sm/q"]
    for name in out:
        assert out[name].dtype == ref[name].dtype
        np.testing.assert_array_equal(out[name], ref[name], err_msg=name)
    assert len(np.unique(ref["sm/q"])) > 10 and len(np.unique(ref["ln/q"])) > 10
    again = program.run(feeds)  # prepared once, run many times
    np.testing.assert_array_equal(again["ln/q"], out["ln/q"])


def test_keep_returns_every_computed_tensor(case):
    w, feeds, ref = case
    out = NpuProgram(body(w)).run(feeds, keep=True)
    for name in ("c/q", "p/q", "t/q", "m/q", "m16/q", "l/q", "a/q", "cat/q", "sm/q", "ln/q", "a0/q", "a1/q"):
        assert name in out
        if name in ref:
            np.testing.assert_array_equal(out[name], ref[name], err_msg=name)


def test_outer_scope_constants(case):
    """Compiled models keep weights at top level; the body only names them."""
    w, feeds, ref = case
    out = NpuProgram(body(w, as_initializers=False), constants=w).run(feeds)
    np.testing.assert_array_equal(out["sm/q"], ref["sm/q"])


def test_split_without_sizes_uses_the_node_outputs(case):
    w, feeds, ref = case
    split = helper.make_node("Split", ["a/q"], ["a0/q", "a1/q"], "split", axis=2)
    concat = helper.make_node("Concat", ["a0/q", "a1/q"], ["cat/q"], "concat", axis=2)
    halves = {"a0/q": (np.uint8, [1, 16, 3]), "a1/q": (np.uint8, [1, 16, 3])}
    out = NpuProgram(body(w, shapes=halves, split=split, concat=concat)).run(feeds, keep=True)
    np.testing.assert_array_equal(out["cat/q"], ref["a/q"])


def test_unknown_op_names_the_node(case):
    w, _, _ = case
    bad = helper.make_node("QFancy", ["t/q"], ["m/q"], "fancy_node", domain=INT)
    graph = body(w, matmul=bad)
    assert unsupported_ops(graph) == {"QFancy"}
    with pytest.raises(PulsarError, match="fancy_node.*QFancy.*not supported"):
        NpuProgram(graph)


def test_bad_nodes_and_feeds_are_user_errors(case):
    w, feeds, _ = case
    wrong_domain = helper.make_node("QConv", ["x/q", "W/q", "B/q", "conv/M", "conv/N"], ["c/q"], "conv", **CONV)
    with pytest.raises(PulsarError, match="conv.*pulsar.int"):
        NpuProgram(body(w, conv=wrong_domain))
    broken = helper.make_node("QConv", ["x/q", "W/q", "B/q", "conv/M", "conv/N"], ["c/q"], "conv", domain=INT,
                              **{**CONV, "out_min": 300})
    with pytest.raises(PulsarError, match="'conv'.*out_min"):
        NpuProgram(body(w, conv=broken))
    program = NpuProgram(body(w))
    with pytest.raises(PulsarError, match="missing input 's/q'"):
        program.run({"x/q": feeds["x/q"]})
    with pytest.raises(PulsarError, match="'x/q' has dtype int8"):
        program.run({**feeds, "x/q": feeds["x/q"].astype(np.int8)})
    with pytest.raises(PulsarError, match="shape"):
        program.run({**feeds, "x/q": feeds["x/q"][:, :, :4]})


def test_value_info_disagreement_is_reported(case):
    w, feeds, _ = case
    program = NpuProgram(body(w, shapes={"m16/q": (np.uint16, [1, 16, 6])}))
    with pytest.raises(PulsarError, match="'to16'.*m16/q.*int16, expected uint16"):
        program.run(feeds)


def test_op_listing(case):
    w, _, _ = case
    ops = body_ops(body(w))
    assert {"QConv", "MaxPool", "QSoftmax", "Constant"} <= ops
    assert ops <= supported_ops()
    assert {"QConv", "QConvTranspose", "QMatMul", "QAdd", "QMul", "Requantize", "QAvgPool", "QReduceMean", "QLut",
            "QSoftmax", "QLayerNorm", "Resize", "Pad", "Gather", "Tile", "Expand"} <= supported_ops()


def test_tensorproto_codes_match_the_out_attrs():
    assert intref.TO[np.dtype(np.uint16)] == TensorProto.UINT16


def test_unwired_input_is_reported_when_building(case):
    w, _, _ = case
    weights_missing = {k: v for k, v in w.items() if k != "Wm/q"}
    with pytest.raises(PulsarError, match="'matmul'.*'Wm/q' is not produced"):
        NpuProgram(body(weights_missing))
