"""Tile / slice mode: a layer whose activations exceed the target's on-chip memory is split into pieces
that fit (pulsar/compiler/tiling.py); the estimate and the trace change, the results do not."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import pulsar
from pulsar.compiler.cost import estimate, estimate_model
from pulsar.compiler.targets import load_profile
from pulsar.compiler.trace import chrome_trace, split_rows, tile_plans
from pulsar.core.container import Subgraph, load_compiled
from pulsar.runtime.session import Session

U8 = TensorProto.UINT8
COMMON = {"out_zp": 0, "out_min": 0, "out_max": 255, "to": U8}
H = 64  # 16 x 64 x 64 in (64 KiB) -> 32 x 64 x 64 out (128 KiB): 192 KiB of activations


def _conv_body(cin: int = 16, cout: int = 32, h: int = H, extra: str = "") -> onnx.GraphProto:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.integers(-5, 6, [cout, cin, 3, 3]).astype(np.int8), "w"),
             numpy_helper.from_array(np.zeros(cout, np.int32), "b"),
             numpy_helper.from_array(np.ones(cout, np.int64), "M"), numpy_helper.from_array(np.ones(cout, np.int64), "N")]
    nodes = [helper.make_node("QConv", ["x", "w", "b", "M", "N"], ["y"], name="conv", domain="pulsar.int", x_zp=0,
                              strides=[1, 1], pads=[1, 1, 1, 1], dilations=[1, 1], group=1, **COMMON)]
    out = "y"
    infos = {"x": [1, cin, h, h], "y": [1, cout, h, h]}
    if extra == "reduce":
        nodes.append(helper.make_node("QReduceMean", ["y"], ["z"], name="mean", domain="pulsar.int", x_zp=0,
                                      axes=[2, 3], keepdims=1, M=1, N=0, **COMMON))
        infos["z"], out = [1, cout, 1, 1], "z"
    vi = {k: helper.make_tensor_value_info(k, U8, s) for k, s in infos.items()}
    return helper.make_graph(nodes, "body", [vi["x"]], [vi[out]], initializer=inits,
                             value_info=[v for k, v in vi.items() if k not in ("x", out)])


@pytest.fixture(scope="module")
def small() -> object:
    """VNPU-S with 128 KiB of SRAM: the 192 KiB conv does not fit, a quarter of it (double-buffered) does."""
    return dataclasses.replace(load_profile("VNPU-S"), onchip_memory_kib=128)


def test_off_the_layer_spills_and_the_estimate_says_so(small) -> None:
    (op,) = estimate(_conv_body(), small).ops
    assert op.schedule == "spill" and op.tiling is None
    assert op.ddr_bytes == 16 * H * H + 32 * H * H + op.workload.weight_bytes
    assert op.cycles == op.compute_cycles + op.memory_cycles + small.op_overhead_cycles  # nothing overlaps
    assert split_rows(estimate_model([Subgraph("npu_0", "npu", _conv_body())], small))[0][2] == "spill"


def test_tile_mode_splits_along_rows_with_halo_reads(small) -> None:
    spilled = estimate(_conv_body(), small).ops[0]
    (op,) = estimate(_conv_body(), small, tile_mode=True).ops
    p = op.tiling
    assert op.schedule == "tile" and p is not None and p.mode == "tile" and p.axis == 2 and p.n >= 2
    assert p.working_set <= small.onchip_bytes
    assert [t.start for t in p.tiles] == [0, *[t.stop for t in p.tiles[:-1]]] and p.tiles[-1].stop == H
    assert all(t.shape == (1, 32, t.stop - t.start, H) for t in p.tiles)
    # 3x3, stride 1, pad 1: each inner boundary re-reads two input rows (16 channels x 64 bytes each)
    halo = (p.n - 1) * 2 * 16 * H
    assert sum(t.in_bytes for t in p.tiles) == 16 * H * H + halo
    assert op.ddr_bytes == spilled.ddr_bytes + halo  # weights resident: loaded once
    assert sum(t.weight_bytes for t in p.tiles) == op.workload.weight_bytes
    assert op.cycles == max(op.compute_cycles, op.memory_cycles) + p.n * small.op_overhead_cycles
    assert op.cycles != spilled.cycles and op.spill_cycles == spilled.cycles


def test_slice_mode_splits_output_channels_and_keeps_the_input(small) -> None:
    spilled = estimate(_conv_body(), small).ops[0]
    (op,) = estimate(_conv_body(), small, slice_mode=True).ops
    p = op.tiling
    assert op.schedule == "slice" and p is not None and p.axis == 1 and p.n >= 2
    assert p.tiles[-1].stop == 32 and all(t.shape[1] == t.stop - t.start for t in p.tiles)
    assert sum(t.in_bytes for t in p.tiles) == 16 * H * H == p.tiles[0].in_bytes  # read once, resident
    assert op.ddr_bytes == spilled.ddr_bytes and op.cycles < spilled.cycles
    both = estimate(_conv_body(), small, tile_mode=True, slice_mode=True).ops[0]
    assert both.cycles == min(op.cycles, estimate(_conv_body(), small, tile_mode=True).ops[0].cycles)


def test_a_layer_that_cannot_split_still_spills(small) -> None:
    tiny = dataclasses.replace(small, onchip_memory_kib=0.25)  # not even one row fits
    (op,) = estimate(_conv_body(), tiny, tile_mode=True, slice_mode=True).ops
    assert op.schedule == "spill"
    reduce = estimate(_conv_body(extra="reduce"), small, tile_mode=True).ops
    # QReduceMean reduces over the rows (no split rule): 128 KiB + 32 B does not fit, it spills
    assert [o.schedule for o in reduce] == ["tile", "spill"]


def test_the_trace_holds_one_event_per_tile(small, tmp_path: Path) -> None:
    est = estimate_model([Subgraph("npu_0", "npu", _conv_body(), {"enable_tile_mode": True})], small)
    doc = json.loads(chrome_trace(est, tmp_path / "t.json").read_text())
    op = est.subgraphs[0].ops[0]
    tiles = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["args"].get("tile") is not None]
    assert [e["args"]["tile"] for e in tiles] == list(range(op.tiling.n))
    assert all(e["args"]["layer"] == "conv" and e["args"]["mode"] == "tile" for e in tiles)
    assert [e["args"]["shape"] for e in tiles] == [list(t.shape) for t in op.tiling.tiles]
    assert tiles[0]["args"]["in_bytes"] > 0 and tiles[0]["args"]["out_bytes"] > 0
    assert sum(e["dur"] for e in tiles) == pytest.approx(op.cycles / small.clock_mhz)
    layer = next(e for e in doc["traceEvents"] if e["ph"] == "X" and e["name"] == "conv")
    assert layer["args"]["schedule"] == "tile" and layer["args"]["tiles"] == op.tiling.n
    assert tile_plans(est)[0]["tiles"][0] == [0, op.tiling.tiles[0].stop]


# ---------------------------------------------------------------------- a whole build

PROFILE = """name: VNPU-TINY
cores: 1
int8_macs_per_cycle_per_core: 256
int16_macs_per_cycle_per_core: 64
clock_mhz: 1000
onchip_memory_kib: 2
ddr_bandwidth_gbps: 4.3
vector_ops_per_cycle_per_core: 32
op_overhead_cycles: 20
"""


@pytest.fixture(scope="module")
def tiled_builds(tiny, tmp_path_factory):
    """The tiny CNN (8 x 16 x 16 activations, ~2.8 KiB for its first conv) on a 2 KiB target, without
    and with tile mode."""
    root = tmp_path_factory.mktemp("tiling")
    (root / "tiny-npu.yaml").write_text(PROFILE)
    quant = {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                                "calibration_format": "Numpy", "calibration_size": 8}]}
    base = {"quant": quant, "target_hardware": str(root / "tiny-npu.yaml")}
    off = pulsar.build(tiny["model"], root / "off", {**base, "compiler": {"npu_perf": True}}, quiet=True)
    on = pulsar.build(tiny["model"], root / "on", {**base, "compiler": {"npu_perf": True, "enable_tile_mode": True}},
                      quiet=True)
    return off, on, root


def test_build_tiles_reports_and_records_the_plan(tiled_builds) -> None:
    off, on, root = tiled_builds
    est_off = load_compiled(off.compiled_model).metadata["estimate"]
    est_on = load_compiled(on.compiled_model).metadata["estimate"]
    assert "tiling" not in est_off and est_on["tiling"]
    assert est_on["cycles"] != est_off["cycles"]
    plan = est_on["tiling"][0]
    assert plan["mode"] == "tile" and len(plan["tiles"]) >= 2
    trace = json.loads((root / "on" / "compiler" / "npu_perf_trace.json").read_text())
    tiles = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["args"].get("layer") == plan["layer"]]
    assert len(tiles) == len(plan["tiles"])
    log = (root / "on" / "build.log").read_text()
    assert f"tile mode: {plan['layer']} split into {len(plan['tiles'])} pieces" in log
    off_log = (root / "off" / "build.log").read_text()
    assert "tile mode:" not in off_log


def test_tiling_does_not_change_results(tiled_builds) -> None:
    off, on, _ = tiled_builds
    x = np.random.default_rng(5).standard_normal((1, 3, 16, 16)).astype(np.float32)
    a = Session(off.compiled_model).run({"image": x})
    b = Session(on.compiled_model).run({"image": x})
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def _depthwise_body(c: int, h: int, stride: int) -> onnx.GraphProto:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.integers(-5, 6, [c, 1, 3, 3]).astype(np.int8), "w"),
             numpy_helper.from_array(np.zeros(c, np.int32), "b"),
             numpy_helper.from_array(np.ones(c, np.int64), "M"), numpy_helper.from_array(np.ones(c, np.int64), "N")]
    ho = (h + 2 - 3) // stride + 1
    node = helper.make_node("QConv", ["x", "w", "b", "M", "N"], ["y"], name="dw", domain="pulsar.int", x_zp=0,
                            strides=[stride, stride], pads=[1, 1, 1, 1], dilations=[1, 1], group=c, **COMMON)
    return helper.make_graph([node], "body", [helper.make_tensor_value_info("x", U8, [1, c, h, h])],
                             [helper.make_tensor_value_info("y", U8, [1, c, ho, ho])], initializer=inits)


def test_a_split_slower_than_spilling_is_not_taken() -> None:
    """MobileNetV2's stride-2 depthwise 96 x 112 x 112 on VNPU-S: 7 row tiles re-read so many halo rows
    that they cost more (367,116 cycles) than spilling (361,497); the layer spills."""
    body = _depthwise_body(96, 112, 2)
    (tiled,) = estimate(body, "VNPU-S", tile_mode=True).ops
    (spilled,) = estimate(body, "VNPU-S").ops
    assert spilled.schedule == "spill"
    assert tiled.schedule == "spill" and tiled.tiling is None and tiled.cycles == spilled.cycles
    (other,) = estimate(_depthwise_body(32, 112, 1), "VNPU-S", tile_mode=True).ops  # here the split pays
    assert other.schedule == "tile" and other.cycles < other.spill_cycles
