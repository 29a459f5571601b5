"""Cost model and Chrome trace on hand-built `pulsar.int` body graphs (value_info on every tensor)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from pulsar.compiler.cost import estimate, estimate_model
from pulsar.compiler.targets import load_profile
from pulsar.compiler.trace import SUMMARY_COLUMNS, chrome_trace, summary_rows
from pulsar.compiler.workload import workloads
from pulsar.core.container import Subgraph
from pulsar.errors import PulsarError

U8, I8, I16, I32, I64 = TensorProto.UINT8, TensorProto.INT8, TensorProto.INT16, TensorProto.INT32, TensorProto.INT64
COMMON = {"out_zp": 0, "out_min": 0, "out_max": 255, "to": U8}


class Body:
    """Builds an NPU body: integer graph inputs, weights as initializers, value_info for the rest."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.infos: dict[str, onnx.ValueInfoProto] = {}
        self.inputs: list[str] = []
        self.rng = np.random.default_rng(0)

    def input(self, name: str, elem: int, shape: list[int]) -> str:
        self.infos[name] = helper.make_tensor_value_info(name, elem, shape)
        self.inputs.append(name)
        return name

    def weight(self, name: str, dtype: type, shape: list[int]) -> str:
        self.inits.append(numpy_helper.from_array(self.rng.integers(-5, 6, shape).astype(dtype), name))
        return name

    def op(self, op_type: str, inputs: list[str], out: str, elem: int, shape: list[int],
           domain: str = "pulsar.int", **attrs: object) -> str:
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=f"{op_type}_{len(self.nodes)}",
                                           domain=domain, **attrs))
        self.infos[out] = helper.make_tensor_value_info(out, elem, shape)
        return out

    def conv(self, x: str, cin: int, cout: int, hw: int, *, stride: int = 1, group: int = 1, bits: int = 8,
             tag: str = "c") -> str:
        wt, xt = (np.int8, U8) if bits == 8 else (np.int16, I16)
        w = self.weight(f"{tag}/w/q", wt, [cout, cin // group, 3, 3])
        b = self.weight(f"{tag}/b/q", np.int32, [cout])
        m = self.weight(f"{tag}/M", np.int64, [cout])
        n = self.weight(f"{tag}/N", np.int64, [cout])
        return self.op("QConv", [x, w, b, m, n], f"{tag}/y/q", xt, [1, cout, hw // stride, hw // stride],
                       x_zp=0, strides=[stride, stride], pads=[1, 1, 1, 1], dilations=[1, 1], group=group,
                       **{**COMMON, "to": xt})

    def graph(self, outputs: list[str]) -> onnx.GraphProto:
        g = helper.make_graph(
            self.nodes, "body", [self.infos[i] for i in self.inputs], [self.infos[o] for o in outputs],
            initializer=self.inits,
            value_info=[v for k, v in self.infos.items() if k not in self.inputs and k not in outputs],
        )
        domains = sorted({n.domain for n in self.nodes} - {""})
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]
                                  + [helper.make_opsetid(d, 1) for d in domains])
        onnx.checker.check_model(model)  # the test bodies are well-formed ONNX
        return g


def conv_body(bits: int = 8, cin: int = 16, cout: int = 32, **kw: object) -> onnx.GraphProto:
    b = Body()
    x = b.input("x/q", U8 if bits == 8 else I16, [1, cin, 32, 32])
    return b.graph([b.conv(x, cin, cout, 32, bits=bits, **kw)])


def fc_body() -> onnx.GraphProto:
    """1x1024 @ 1024x1024 int8 weights: 1 MiB of weights for 1 M MACs, memory bound everywhere."""
    b = Body()
    a = b.input("a/q", U8, [1, 1024])
    w = b.weight("fc/w/q", np.int8, [1024, 1024])
    m, n = b.weight("fc/M", np.int64, [1]), b.weight("fc/N", np.int64, [1])
    y = b.op("QMatMul", [a, w, "", m, n], "fc/y/q", U8, [1, 1024], a_zp=128, b_zp=0, trans_b=0, **COMMON)
    return b.graph([y])


def test_conv_workload_counts() -> None:
    (w,) = workloads(conv_body())
    assert w.op_type == "QConv" and w.unit == "mac" and w.operand_bits == 8
    assert w.macs == 32 * 32 * 32 * 16 * 9
    assert w.bytes_read == 16 * 32 * 32
    assert w.bytes_written == 32 * 32 * 32
    assert w.weight_bytes == 32 * 16 * 9 + 32 * 4 + 2 * 32 * 8
    assert w.note == ""


def test_conv_variants() -> None:
    (dw,) = workloads(conv_body(group=16))  # depthwise-like: 16 groups of 1 input channel
    assert dw.macs == 32 * 32 * 32 * 1 * 9
    (s2,) = workloads(conv_body(stride=2))
    assert s2.macs == 16 * 16 * 32 * 16 * 9 and s2.bytes_written == 32 * 16 * 16
    (wide,) = workloads(conv_body(bits=16))
    assert wide.operand_bits == 16 and wide.bytes_read == 2 * 16 * 32 * 32


def test_conv_transpose_and_matmul_macs() -> None:
    b = Body()
    x = b.input("x/q", U8, [1, 8, 8, 8])
    w = b.weight("t/w/q", np.int8, [8, 4, 2, 2])
    m, n = b.weight("t/M", np.int64, [4]), b.weight("t/N", np.int64, [4])
    y = b.op("QConvTranspose", [x, w, "", m, n], "t/y/q", U8, [1, 4, 16, 16], x_zp=0, strides=[2, 2],
             pads=[0, 0, 0, 0], output_padding=[0, 0], dilations=[1, 1], group=1, **COMMON)
    a = b.input("a/q", I16, [1, 128, 64])
    wb = b.weight("mm/w/q", np.int8, [256, 64])
    mm = b.op("QMatMul", [a, wb, "", m, n], "mm/y/q", I16, [1, 128, 256], a_zp=0, b_zp=0, trans_b=1,
              **{**COMMON, "to": I16})
    q = b.input("q/q", U8, [1, 4, 16, 32])
    k = b.input("k/q", U8, [1, 4, 16, 32])
    att = b.op("QMatMul", [q, k, "", m, n], "att/q", U8, [1, 4, 16, 16], a_zp=128, b_zp=128, trans_b=1, **COMMON)
    tw, mw, aw = workloads(b.graph([y, mm, att]))
    assert tw.macs == 8 * 8 * 8 * 4 * 2 * 2  # every input element scatters into Cout * kh * kw outputs
    assert mw.macs == 128 * 256 * 64 and mw.operand_bits == 16
    assert aw.macs == 4 * 16 * 16 * 32 and aw.bytes_read == 2 * 4 * 16 * 32 and aw.weight_bytes == 2 * 4 * 8


def test_vector_view_and_unknown_ops() -> None:
    b = Body()
    x = b.input("x/q", U8, [1, 32, 8, 8])
    z = b.input("z/q", U8, [1, 32, 8, 8])
    s = b.op("QAdd", [x, z], "s/q", U8, [1, 32, 8, 8], a_zp=1, b_zp=2, Ma=3, Mb=4, N=5, **COMMON)
    table = b.weight("lut/t", np.int32, [256])
    lut = b.op("QLut", [s, table], "lut/q", U8, [1, 32, 8, 8], step_bits=0, **COMMON)
    shape = b.weight("r/shape", np.int64, [2])
    r = b.op("Reshape", [lut, shape], "r/q", U8, [1, 2048], domain="")
    f = b.op("Frobnicate", [r], "f/q", U8, [1, 2048], domain="acme")
    g = b.graph([f])
    add, lw, rw, fw = workloads(g)
    assert add.elementwise_ops == 4 * 2048 and add.macs == 0 and add.bytes_read == 2 * 2048
    assert lw.elementwise_ops == 2 * 2048 and lw.weight_bytes == 256 * 4
    assert rw.unit == "none" and rw.bytes_read == rw.bytes_written == 0
    assert fw.elementwise_ops == 2048 and "acme:Frobnicate" in fw.note
    est = estimate(g, "VNPU-M")
    assert [o.cycles == 0 for o in est.ops] == [False, False, True, False]
    assert any("Frobnicate" in n for n in est.notes)


def test_more_cores_fewer_cycles_when_compute_bound() -> None:
    g = conv_body(cin=64, cout=64)
    one = estimate(g, "VNPU-M", "NPU1")
    two = estimate(g, "VNPU-M", "NPU2")
    (op1,), (op2,) = one.ops, two.ops
    assert op1.bound == op2.bound == "compute"
    assert op1.compute_cycles == math.ceil(32 * 32 * 64 * 64 * 9 / 1024)
    assert op2.compute_cycles == math.ceil(op1.compute_cycles / 2)
    assert two.cycles < one.cycles
    assert one.time_ms == pytest.approx(one.cycles / 800e3)
    assert one.tops == pytest.approx(2 * one.macs / (one.time_ms * 1e-3) / 1e12)
    four = estimate(g, "VNPU-L", "NPU4")
    assert four.cycles < estimate(g, "VNPU-L", "NPU1").cycles
    with pytest.raises(PulsarError, match="npu_mode NPU4.*VNPU-M"):
        estimate(g, "VNPU-M", "NPU4")


def test_int16_operands_use_the_slower_rate() -> None:
    p = load_profile("VNPU-M")
    c8, c16 = estimate(conv_body(), p).ops[0], estimate(conv_body(bits=16), p).ops[0]
    assert c16.compute_cycles == 4 * c8.compute_cycles


def test_lower_ddr_limit_more_cycles_when_memory_bound() -> None:
    g = fc_body()
    free = estimate(g, "VNPU-M")
    (op,) = free.ops
    assert op.bound == "memory" and op.ddr_bytes >= 1024 * 1024
    assert op.memory_cycles == math.ceil(op.ddr_bytes / (12.8e9 / 800e6))
    capped = estimate(g, "VNPU-M", ddr_bw_limit_gbps=3.2)
    assert capped.cycles > free.cycles and capped.ddr_bandwidth_gbps == 3.2
    assert capped.ops[0].memory_cycles == pytest.approx(4 * op.memory_cycles, rel=1e-3)
    assert estimate(g, "VNPU-M", ddr_bw_limit_gbps=100.0).cycles == free.cycles  # above the profile: no effect
    assert estimate(g, "VNPU-M", "NPU2").ops[0].memory_cycles == op.memory_cycles  # DDR is shared
    with pytest.raises(PulsarError, match="compiler.ddr_bw_limit"):
        estimate(g, "VNPU-M", ddr_bw_limit_gbps=-1)


def test_onchip_memory_keeps_intermediates_off_ddr() -> None:
    b = Body()
    x = b.input("x/q", U8, [1, 16, 32, 32])
    y = b.conv(b.conv(x, 16, 32, 32, tag="c1"), 32, 32, 32, tag="c2")
    g = b.graph([y])
    big = load_profile("VNPU-M")
    first, second = estimate(g, big).ops
    assert first.ddr_bytes == 16 * 32 * 32 + first.workload.weight_bytes  # reads x, keeps its output on chip
    assert second.ddr_bytes == 32 * 32 * 32 + second.workload.weight_bytes  # writes only the graph output
    small = dataclasses.replace(big, onchip_memory_kib=16)
    s1, s2 = estimate(g, small).ops
    assert s1.ddr_bytes == first.ddr_bytes + 32 * 32 * 32  # spills its output
    assert s2.ddr_bytes == second.ddr_bytes + 32 * 32 * 32  # and reads it back


def two_subgraphs() -> list[Subgraph]:
    return [
        Subgraph("cpu_pre", "cpu", onnx.GraphProto()),
        Subgraph("npu_0", "npu", conv_body()),
        Subgraph("npu_1", "npu", fc_body()),
    ]


def test_estimate_model_sequences_npu_subgraphs() -> None:
    est = estimate_model(two_subgraphs(), "VNPU-M", "NPU2", 6.4)
    assert est.not_estimated == ["cpu_pre"]
    a, b = est.subgraphs
    assert (a.name, b.name) == ("npu_0", "npu_1")
    assert (a.start_cycle, b.start_cycle) == (0, a.cycles)
    assert est.cycles == a.cycles + b.cycles and est.macs == a.macs + b.macs
    assert est.cores == 2 and est.ddr_bandwidth_gbps == 6.4
    assert [o.start_cycle for o in b.ops] == [0]
    assert est.tops == pytest.approx(2 * est.macs / (est.time_ms * 1e-3) / 1e12)


def test_chrome_trace_is_valid_and_sequential(tmp_path: Path) -> None:
    # a multi-op subgraph too, so the sequential order inside one process is checked
    b = Body()
    y = b.conv(b.conv(b.input("x/q", U8, [1, 16, 32, 32]), 16, 32, 32, tag="c1"), 32, 32, 32, tag="c2")
    est = estimate_model([*two_subgraphs(), Subgraph("npu_2", "npu", b.graph([y]))], "VNPU-M")
    path = chrome_trace(est, tmp_path / "trace" / "npu.json")
    assert path.is_file() and [p.name for p in path.parent.iterdir()] == ["npu.json"]  # no temp file left
    with path.open() as fh:
        doc = json.load(fh)
    assert doc["displayTimeUnit"] == "ns" and doc["otherData"]["target_hardware"] == "VNPU-M"
    assert doc["otherData"]["not_estimated"] == ["cpu_pre"]
    events = doc["traceEvents"]
    xs = [e for e in events if e["ph"] == "X"]
    ops = [op for sg in est.subgraphs for op in sg.ops]
    assert len(xs) == len(ops) == 4
    assert [e["name"] for e in xs] == [op.name for op in ops]
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert {pid for pid, _ in names} == {e["pid"] for e in xs} == {1, 2, 3}
    assert all(e["tid"] in {t["tid"] for t in events if t["ph"] == "M" and t["name"] == "thread_name"
                            and t["pid"] == e["pid"]} for e in xs)
    xs.sort(key=lambda e: e["ts"])
    assert xs[0]["ts"] == 0
    for prev, nxt in zip(xs, xs[1:], strict=False):
        assert nxt["ts"] == pytest.approx(prev["ts"] + prev["dur"], abs=1e-9)  # back to back, no overlap
    for e, op in zip(xs, ops, strict=True):
        assert e["dur"] == pytest.approx(op.cycles / 800)
        assert e["args"]["macs"] == op.workload.macs and e["args"]["bound"] == op.bound
    assert xs[-1]["ts"] + xs[-1]["dur"] == pytest.approx(est.time_ms * 1e3)


def test_summary_rows() -> None:
    est = estimate_model(two_subgraphs(), "VNPU-M")
    rows = summary_rows(est)
    assert all(set(r) == set(SUMMARY_COLUMNS) for r in rows)
    assert [r["subgraph"] for r in rows] == ["npu_0", "npu_1", "cpu_pre (cpu, not estimated)", "total"]
    conv, fc, cpu, total = rows
    assert conv["compute_share"] == 1.0 and fc["memory_share"] == 1.0 and cpu["cycles"] is None
    assert total["cycles"] == conv["cycles"] + fc["cycles"] == est.cycles
    assert total["ms"] == pytest.approx(est.time_ms) and total["ops"] == 2
    assert total["compute_share"] + total["memory_share"] == pytest.approx(1.0)
    assert total["compute_share"] == pytest.approx(conv["cycles"] / est.cycles)
