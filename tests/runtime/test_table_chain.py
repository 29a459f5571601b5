"""A table lookup and the Requantize after it run as one gather (NpuProgram without per-layer dumps):
same bits as the two kernels in turn and as the Python-int reference, on 8- and 16-bit codes, and
never fused where the lookup's result is read elsewhere or returned."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper, numpy_helper

from pulsar.runtime.npu_sim import NpuProgram
from tests.runtime.kernels import intref

RNG = np.random.default_rng(28)
INT = "pulsar.int"


def vi(name: str, dtype, shape) -> object:
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), shape)


def chain(xdt, step_bits: int):
    """x -> QLut (int32 table) -> Requantize (to uint8) -> y, and x -> QLut -> {Requantize, QAdd} -> z,
    w (the second lookup is read twice; the third one's result is a graph output)."""
    codes = 1 << (8 * np.dtype(xdt).itemsize)
    size = codes if step_bits == 0 else ((codes - 1) >> step_bits) + 2
    table = RNG.integers(-(1 << 20), 1 << 20, size=size).astype(np.int32)
    table[:3] = [-(1 << 31) + 1, (1 << 31) - 1, 0]  # extremes of the int32 output
    lut = {"step_bits": step_bits, **intref.out_attrs(np.int32)}
    rq = {"x_zp": -77, "M": 1518500250, "N": 44, **intref.out_attrs(np.uint8, 128)}
    add = {"a_zp": 0, "b_zp": 0, "Ma": 1, "Mb": 1, "N": 0, **intref.out_attrs(np.int32)}
    n = helper.make_node
    nodes = [
        n("QLut", ["x", "table"], ["l1"], "lut1", domain=INT, **lut),
        n("Requantize", ["l1"], ["y"], "rq1", domain=INT, **rq),
        n("QLut", ["x", "table"], ["l2"], "lut2", domain=INT, **lut),
        n("Requantize", ["l2"], ["r2"], "rq2", domain=INT, **rq),
        n("QAdd", ["l2", "l2"], ["z"], "add", domain=INT, **add),
        n("QLut", ["x", "table"], ["w"], "lut3", domain=INT, **lut),
        n("Requantize", ["w"], ["r3"], "rq3", domain=INT, **rq),
    ]
    shape = [2, 3, 4, 5]
    graph = helper.make_graph(nodes, "npu_0", [vi("x", xdt, shape)],
                              [vi("y", np.uint8, shape), vi("z", np.int32, shape), vi("w", np.int32, shape),
                               vi("r2", np.uint8, shape), vi("r3", np.uint8, shape)],
                              initializer=[numpy_helper.from_array(table, "table")])
    return graph, table, lut, rq


@pytest.mark.parametrize("xdt,step_bits", [(np.int16, 8), (np.uint16, 0), (np.int8, 0), (np.uint8, 3)])
def test_lookup_and_requantize_fuse_exactly(xdt, step_bits):
    graph, table, lut, rq = chain(xdt, step_bits)
    program = NpuProgram(graph)
    fused = [s.op for s in program._fast]
    assert fused.count("QLut+Requantize") == 1  # only the lookup read by the Requantize alone
    assert len(fused) == len(program.steps) - 1
    info = np.iinfo(xdt)
    x = RNG.integers(info.min, info.max, size=(2, 3, 4, 5), endpoint=True).astype(xdt)
    x.reshape(-1)[:4] = [info.min, info.max, info.min + 1, info.max - 1]
    x = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)  # channels-last, as convs leave it
    fast = program.run({"x": x})
    slow = program.run({"x": x}, keep=True)
    want = intref.requantize(intref.qlut(np.ascontiguousarray(x), table, lut), rq)
    for name in ("y", "z", "w", "r2", "r3"):
        np.testing.assert_array_equal(fast[name], slow[name])
        assert fast[name].dtype == slow[name].dtype
    np.testing.assert_array_equal(fast["y"], want)
    assert len(np.unique(want)) > 5
