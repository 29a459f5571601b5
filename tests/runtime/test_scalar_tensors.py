"""Rank-0 (scalar) tensors keep shape () through the lowering and the bit-exact simulator.

Regression: a scalar activation times a scalar constant (QMul with ``b = <node>/one``) came out with
shape (1,): the lowering padded the rank-0 constant's ones and per-tensor (M, N) to shape [1], and
numpy gives a scalar, not a 0-d array, from arithmetic, reductions and gathers of rank 0 (which the
in-place clamp of the requantization rejected). ``np.ascontiguousarray`` made a rank-0 Transpose /
Expand 1-D.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import pulsar
from pulsar.core.container import load_compiled
from pulsar.runtime.kernels import KERNELS
from pulsar.runtime.session import Session


def _scalar_model(path: Path) -> Path:
    """x [2, 8] -> max / min over every axis (rank 0) -> Sub, Div and Mul by scalar constants, Mul of
    two scalar activations, Add of a constant: every quantized NPU op sees rank-0 operands."""
    consts = [numpy_helper.from_array(np.float32(v), n) for v, n in ((255.0, "k255"), (0.5, "half"), (1.0, "one"))]
    nodes = [
        helper.make_node("ReduceMax", ["x"], ["mx"], keepdims=0),
        helper.make_node("ReduceMin", ["x"], ["mn"], keepdims=0),
        helper.make_node("Sub", ["mx", "mn"], ["rng"]),
        helper.make_node("Div", ["rng", "k255"], ["scale"]),
        helper.make_node("Mul", ["mx", "half"], ["hm"]),
        helper.make_node("Mul", ["hm", "rng"], ["prod"]),
        helper.make_node("Add", ["prod", "one"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "scalars", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("scale", TensorProto.FLOAT, []),
                               helper.make_tensor_value_info("y", TensorProto.FLOAT, [])], initializer=consts)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)
    return path


def _sample(rng: np.random.Generator) -> np.ndarray:
    return (rng.standard_normal((2, 8)) * 2 + 1).astype(np.float32)


def test_scalar_chain_runs_on_npu_with_rank0_shapes(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    calib = tmp_path / "calib"
    calib.mkdir()
    for i in range(4):
        np.save(calib / f"{i}.npy", _sample(rng))
    cfg = {"quant": {"input_configs": [{"tensor_name": "x", "calibration_dataset": str(calib),
                                        "calibration_format": "Numpy", "calibration_size": 4}]}}
    res = pulsar.build(_scalar_model(tmp_path / "m.onnx"), tmp_path / "out", cfg, quiet=True)
    compiled = load_compiled(res.compiled_model)
    npu = [sg for sg in compiled.subgraphs if sg.kind == "npu"]
    assert {"QMul", "QAdd"} <= {n.op_type for sg in npu for n in sg.graph.node}, "the scalar ops must run on the NPU"

    quantized = onnx.load(res.quantized_model)
    step = {t.name: float(numpy_helper.to_array(t)) for t in quantized.graph.initializer if t.name.endswith("/scale")}
    feeds = {"x": _sample(rng)}
    ref = Session(res.compiled_model, mode="Reference").run(feeds)
    npu_out = Session(res.compiled_model, mode="NPUBackend").run(feeds)
    for name in ("scale", "y"):
        assert isinstance(npu_out[name], np.ndarray) and npu_out[name].shape == ()
        assert ref[name].shape == ()
        assert abs(float(npu_out[name]) - float(ref[name])) <= step[f"{name}/scale"] * 1.001, name

    inits = {t.name: t for t in compiled.model.graph.initializer}
    for sg in npu:
        inits.update({t.name: t for t in sg.graph.initializer})
        for node in sg.graph.node:
            if node.op_type == "QMul":  # a, b scalars: the per-tensor one / M / N must not raise the rank
                assert all(list(inits[name].dims) == [] for name in node.input[1:] if name in inits), node.name


U8 = 2  # ONNX element type of the outputs below


def _u8(v) -> np.ndarray:
    return np.array(v, np.uint8)


def _i64(v) -> np.ndarray:
    return np.array(v, np.int64)


# (op, attrs, rank-0 inputs, which inputs are constants of the node): every kernel that takes a
# rank-0 tensor, on its exact and literal evaluation paths
CASES = [
    ("QMul", {"to": U8, "a_zp": 3}, [_u8(7), np.array(1, np.int8), _i64(5), _i64(2)], (1, 2, 3)),
    ("QMul", {"to": U8, "a_zp": 3, "b_zp": 2}, [_u8(7), _u8(9), _i64(5), _i64(2)], ()),
    ("QMul", {"to": 6, "a_zp": 3, "b_zp": 2}, [_u8(200), _u8(9), _i64(1 << 40), _i64(3)], ()),
    ("QAdd", {"to": U8, "Ma": 3, "Mb": -2, "N": 2, "a_zp": 1, "b_zp": 4}, [_u8(7), _u8(9)], ()),
    ("QAdd", {"to": U8, "Ma": 3, "Mb": 1, "N": 2, "a_zp": 1}, [_i64(-40), _u8(9)], (0,)),
    ("QAdd", {"to": U8, "Ma": 3, "Mb": 1, "N": 2, "a_zp": 1}, [_u8(7), _i64(1 << 40)], ()),
    ("Requantize", {"to": U8, "M": 3, "N": 1, "x_zp": 2}, [_u8(7)], ()),
    ("Requantize", {"to": 6, "M": 1 << 40, "N": 30, "x_zp": 2}, [np.array(7, np.int32)], ()),
    ("QLut", {"to": U8}, [_u8(7), np.arange(256, dtype=np.int64)], (1,)),
    ("QLut", {"to": 4, "step_bits": 8}, [np.array(700, np.uint16), np.arange(258, dtype=np.int64) * 100], (1,)),
    ("Transpose", {}, [_u8(4)], ()),
    ("Expand", {}, [_u8(4), _i64(np.zeros(0, np.int64))], (1,)),
    ("Tile", {}, [_u8(4), _i64(np.zeros(0, np.int64))], (1,)),
    ("Pad", {}, [_u8(4), _i64(np.zeros(0, np.int64))], (1,)),
    ("Identity", {}, [_u8(4)], ()),
]


def _kernel_out(op: str, attrs: dict, inputs: list[np.ndarray], const_at: tuple[int, ...]) -> np.ndarray:
    consts = [v if i in const_at else None for i, v in enumerate(inputs)]
    return KERNELS[op](attrs, consts)(list(inputs))[0]


def _rank1(op: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """The same inputs one dimension up (shape-carrying inputs given for rank 1)."""
    if op in ("Expand", "Tile"):
        return [inputs[0].reshape(1), _i64([1])]
    if op == "Pad":
        return [inputs[0].reshape(1), _i64([0, 0])]
    if op == "QLut":
        return [inputs[0].reshape(1), inputs[1]]
    return [v.reshape(1) if v.ndim == 0 else v for v in inputs]


@pytest.mark.parametrize(("op", "attrs", "inputs", "const_at"), CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_kernel_keeps_rank0(op: str, attrs: dict, inputs: list[np.ndarray], const_at: tuple[int, ...]) -> None:
    """A rank-0 input gives a 0-d ndarray (not a numpy scalar, not shape (1,)), equal to the rank-1 result."""
    got = _kernel_out(op, attrs, inputs, const_at)
    assert isinstance(got, np.ndarray) and got.shape == (), (type(got), np.shape(got))
    want = _kernel_out(op, attrs, _rank1(op, inputs), const_at)
    assert want.shape == (1,) and got.dtype == want.dtype and got == want[0]


@pytest.mark.parametrize("keepdims_rank", [1, 3])
def test_reductions_over_every_axis_give_rank0_arrays(keepdims_rank: int) -> None:
    x = np.arange(1, 1 + 2 ** keepdims_rank, dtype=np.uint8).reshape((2,) * keepdims_rank)
    mean = KERNELS["QReduceMean"]({"to": U8, "keepdims": 0, "M": 3, "N": 2, "x_zp": 1}, [None])([x])[0]
    top = KERNELS["ReduceMax"]({"keepdims": 0}, [None])([x])[0]
    assert isinstance(mean, np.ndarray) and mean.shape == () and int(mean) == (3 * int((x.astype(int) - 1).sum()) + 2) >> 2
    assert isinstance(top, np.ndarray) and top.shape == () and int(top) == int(x.max())


def test_gather_scalar_index_and_vector_dot_give_rank0_arrays() -> None:
    picked = KERNELS["Gather"]({"axis": 0}, [None, None])([_u8([4, 5]), _i64(1)])[0]
    assert isinstance(picked, np.ndarray) and picked.shape == () and int(picked) == 5
    a, b = _u8([1, 2, 3]), _u8([4, 5, 6])
    attrs = {"to": U8, "a_zp": 1, "b_zp": 2}
    for m, n in ((_i64([3]), _i64([2])), (_i64(3), _i64(2))):
        dot = KERNELS["QMatMul"](attrs, [None] * 5)([a, b, None, m, n])[0]
        assert isinstance(dot, np.ndarray) and dot.shape == ()
        assert int(dot) == (3 * int(((a.astype(int) - 1) * (b.astype(int) - 2)).sum()) + 2) >> 2
