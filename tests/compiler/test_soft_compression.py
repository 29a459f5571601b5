"""compiler.enable_data_soft_compression: NPU weights stored compressed in DDR where that is smaller
(pulsar/compiler/compression.py); the estimate's weight traffic drops, the results do not change."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from rich.console import Console

import pulsar
from pulsar.compiler.compression import layer_weights, pack, weight_packing
from pulsar.compiler.cost import estimate, estimate_model
from pulsar.compiler.targets import load_profile
from pulsar.compiler.trace import chrome_trace, compression_summary
from pulsar.core.container import Subgraph, load_compiled
from pulsar.core.container_schema import metadata_problem
from pulsar.runtime.info import model_summary
from pulsar.runtime.session import Session
from tests.tiny_model import make_numpy_calibration

U8 = TensorProto.UINT8
COMMON = {"out_zp": 0, "out_min": 0, "out_max": 255, "to": U8}


def _codes(sparsity: float, seed: int = 0, shape: tuple[int, ...] = (32, 16, 3, 3)) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.integers(-100, 101, shape).astype(np.int8)
    w[rng.random(shape) < sparsity] = 0
    return w


def _conv_body(w: np.ndarray, *, dense_consts: bool = False, h: int = 8) -> onnx.GraphProto:
    """A QConv with weights ``w``; its multipliers and shifts equal per channel (runs), or distinct."""
    cout, cin = w.shape[:2]
    rng = np.random.default_rng(1)
    m, n = (rng.integers(1 << 20, 1 << 30, (2, cout)) if dense_consts else np.ones((2, cout))).astype(np.int64)
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.arange(cout, dtype=np.int32), "b"),
             numpy_helper.from_array(m, "M"), numpy_helper.from_array(n, "N")]
    node = helper.make_node("QConv", ["x", "w", "b", "M", "N"], ["y"], name="conv", domain="pulsar.int", x_zp=0,
                            strides=[1, 1], pads=[1, 1, 1, 1], dilations=[1, 1], group=1, **COMMON)
    return helper.make_graph([node], "body", [helper.make_tensor_value_info("x", U8, [1, cin, h, h])],
                             [helper.make_tensor_value_info("y", U8, [1, cout, h, h])], initializer=inits)


@pytest.fixture(scope="module")
def vnpu_s():
    return load_profile("VNPU-S")


def test_encodings_pick_the_smallest_and_leave_dense_codes_raw() -> None:
    sparse = pack(numpy_helper.from_array(_codes(0.7), "w"))
    n = 32 * 16 * 9
    assert sparse.encoding == "bitmap" and sparse.raw == n
    nonzero = int(np.count_nonzero(_codes(0.7)))
    assert sparse.stored == (n + 7) // 8 + nonzero + 1  # bitmap + the other codes + the common code
    dense = pack(numpy_helper.from_array(_codes(0.0), "w"))
    assert (dense.encoding, dense.stored) == ("raw", n)
    runs = pack(numpy_helper.from_array(np.full(1000, 7, np.int8), "w"))  # one value: 4 runs of <= 256
    assert (runs.encoding, runs.stored) == ("runs", 4 * 2)
    floats = pack(numpy_helper.from_array(np.zeros(64, np.float32), "f"))  # not integer codes: never compressed
    assert (floats.encoding, floats.stored) == ("raw", 256)


def test_sparse_weights_cut_ddr_traffic_and_the_estimate(vnpu_s) -> None:
    body = _conv_body(_codes(0.7))
    (off,) = estimate(body, vnpu_s).ops
    (on,) = estimate(body, vnpu_s, soft_compression=True).ops
    assert off.weights is None and on.weights is not None and on.weights.compressed
    assert on.weights.raw == off.workload.weight_bytes
    saved = on.weights.raw - on.weights.stored
    assert saved > 0.4 * 32 * 16 * 9  # ~70% zeros of the int8 weights, less the bitmap
    assert on.ddr_bytes == off.ddr_bytes - saved
    assert off.bound == "memory" and on.cycles < off.cycles  # memory-bound: fewer bytes, fewer cycles
    assert on.compute_cycles == off.compute_cycles  # VNPU-S expands in the DMA: no decompression cost


def test_dense_weights_stay_raw_and_the_estimate_is_unchanged(vnpu_s) -> None:
    body = _conv_body(_codes(0.0), dense_consts=True)
    (off,) = estimate(body, vnpu_s).ops
    (on,) = estimate(body, vnpu_s, soft_compression=True).ops
    assert on.weights is not None and not on.weights.compressed and on.weights.encoding == "raw"
    assert (on.cycles, on.ddr_bytes, on.memory_cycles) == (off.cycles, off.ddr_bytes, off.memory_cycles)


def test_decompression_cost_from_the_profile_and_a_layer_it_does_not_pay_for_stays_raw(vnpu_s) -> None:
    body = _conv_body(_codes(0.7))
    (free,) = estimate(body, vnpu_s, soft_compression=True).ops
    fast = dataclasses.replace(vnpu_s, decompress_bytes_per_cycle_per_core=64)
    (op,) = estimate(body, fast, soft_compression=True).ops
    assert op.weights is not None and op.weights.compressed
    expanded = sum(p.raw for p in weight_packing(body).values() if p.encoding != "raw")
    assert op.weights.decompress_cycles == -(-expanded // 64) > 0
    assert op.compute_cycles == free.compute_cycles + op.weights.decompress_cycles
    slow = dataclasses.replace(vnpu_s, decompress_bytes_per_cycle_per_core=1)  # expanding beats the DDR time
    (raw_op,) = estimate(body, slow, soft_compression=True).ops
    (off,) = estimate(body, slow).ops
    assert raw_op.weights is not None and not raw_op.weights.compressed and raw_op.cycles == off.cycles


def test_a_split_layer_loads_its_weights_compressed(vnpu_s) -> None:
    small = dataclasses.replace(vnpu_s, onchip_memory_kib=16)  # 96 KiB of activations: tiled, weights resident
    body = _conv_body(_codes(0.7), h=32)
    (off,) = estimate(body, small, tile_mode=True).ops
    (on,) = estimate(body, small, tile_mode=True, soft_compression=True).ops
    assert off.schedule == on.schedule == "tile" and off.tiling == on.tiling and off.tiling is not None
    assert on.weights is not None and on.weights.compressed
    assert off.tiling.weight_bytes == on.weights.raw  # loaded once, by the first piece
    assert on.ddr_bytes == off.ddr_bytes - on.weights.raw + on.weights.stored
    assert on.cycles <= off.cycles and on.spill_cycles < off.spill_cycles  # spilled, it would save too


def test_layer_weights_sum_the_constants_of_a_layer() -> None:
    packing = weight_packing(_conv_body(_codes(0.7)))
    lw = layer_weights(["x", "w", "b", "M", "N"], packing, 0)
    assert lw.raw == 32 * 16 * 9 + 32 * 4 + 2 * 32 * 8
    assert lw.stored == sum(p.stored for p in packing.values()) and lw.decompress_cycles == 0
    assert set(lw.encoding.split("+")) == {p.encoding for p in packing.values()} - {"raw"}


def test_a_subgraphs_own_option_wins_and_the_trace_records_the_bytes(vnpu_s, tmp_path: Path) -> None:
    body = _conv_body(_codes(0.7))
    sgs = [Subgraph("npu_0", "npu", body), Subgraph("npu_1", "npu", body, {"enable_data_soft_compression": True}),
           Subgraph("npu_2", "npu", body, {"enable_data_soft_compression": False})]
    off = estimate_model(sgs, vnpu_s)
    assert [s.soft_compression for s in off.subgraphs] == [False, True, False]
    on = estimate_model(sgs, vnpu_s, soft_compression=True)
    assert [s.soft_compression for s in on.subgraphs] == [True, True, False]
    assert on.subgraphs[0].ddr_bytes == on.subgraphs[1].ddr_bytes < on.subgraphs[2].ddr_bytes
    raw, stored = on.weight_bytes
    assert raw == 3 * off.subgraphs[0].ops[0].workload.weight_bytes and stored < raw
    summary = compression_summary(on)
    assert summary is not None and summary["subgraphs"] == ["npu_0", "npu_1"]
    assert summary["raw_bytes"] == 2 * raw // 3 and summary["stored_bytes"] < summary["raw_bytes"]
    assert compression_summary(estimate_model(sgs[2:], vnpu_s)) is None
    doc = json.loads(chrome_trace(on, tmp_path / "t.json").read_text())
    convs = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["name"] == "conv"]
    assert [e["args"].get("weight_encoding") for e in convs] == ["bitmap+runs", "bitmap+runs", None]  # w; M, N
    assert convs[0]["args"]["weight_stored_bytes"] < convs[0]["args"]["weight_bytes"]
    assert doc["otherData"]["weight_stored_bytes"] == stored


# ---------------------------------------------------------------------- a whole build


def _sparse_model(path: Path) -> Path:
    """Conv 16 -> 32 (3x3, 70% of its weights zero) + Relu, then a dense 1x1 Conv 32 -> 16."""
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((32, 16, 3, 3)) * 0.2).astype(np.float32)
    w1[rng.random(w1.shape) < 0.7] = 0.0
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array((rng.standard_normal(32) * 0.1)
                                                                         .astype(np.float32), "b1"),
             numpy_helper.from_array((rng.standard_normal((16, 32, 1, 1)) * 0.2).astype(np.float32), "w2"),
             numpy_helper.from_array((rng.standard_normal(16) * 0.1).astype(np.float32), "b2")]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="sparse_conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["y"], name="dense_conv")]
    graph = helper.make_graph(nodes, "sparse", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 8, 8])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    root = tmp_path_factory.mktemp("soft")
    model = _sparse_model(root / "sparse.onnx")
    calib = make_numpy_calibration(root / "calib", shape=(1, 16, 8, 8))
    quant = {"input_configs": [{"tensor_name": "x", "calibration_dataset": str(calib), "calibration_format": "Numpy",
                                "calibration_size": 8}]}
    base = {"quant": quant, "target_hardware": "VNPU-S"}
    out = {}
    for name, compiler in (("off", {}), ("on", {"enable_data_soft_compression": True, "npu_perf": True}),
                           ("ranged", {"sub_configs": [{"start_tensor_names": ["r1"], "end_tensor_names": ["y"],
                                                        "enable_data_soft_compression": True}]})):
        out[name] = pulsar.build(model, root / name, {**base, "compiler": compiler}, quiet=True)
    return out, root


def test_build_records_raw_and_stored_weight_bytes(builds) -> None:
    out, root = builds
    off = load_compiled(out["off"].compiled_model).metadata
    on = load_compiled(out["on"].compiled_model).metadata
    assert metadata_problem(on) is None and metadata_problem(off) is None
    assert "soft_compression" not in off["estimate"]
    packed = on["estimate"]["soft_compression"]
    assert packed["stored_bytes"] < packed["raw_bytes"] and 0 < packed["ratio"] < 1
    layers = {x["layer"]: x for x in packed["layers"]}
    sparse = next(x for name, x in layers.items() if "sparse_conv" in name)
    dense = next(x for name, x in layers.items() if "dense_conv" in name)
    assert sparse["stored_bytes"] < 0.6 * sparse["raw_bytes"] and "bitmap" in sparse["encoding"]
    # the dense layer's weight codes stay raw (only its equal shifts compress)
    (npu,) = [sg for sg in load_compiled(out["on"].compiled_model).subgraphs if sg.kind == "npu"]
    packing = weight_packing(npu.graph)
    (w2,) = [p for name, p in packing.items() if name.startswith("w2")]
    assert w2.encoding == "raw" and dense["stored_bytes"] >= w2.raw
    assert on["estimate"]["cycles"] <= off["estimate"]["cycles"]
    log = (root / "on" / "build.log").read_text()
    assert f"data soft compression: NPU weights {packed['raw_bytes']:,} -> {packed['stored_bytes']:,} bytes" in log
    trace = json.loads((root / "on" / "compiler" / "npu_perf_trace.json").read_text())
    stored = [e["args"]["weight_stored_bytes"] for e in trace["traceEvents"] if e["ph"] == "X"
              and "weight_stored_bytes" in e["args"] and e["args"]["weight_bytes"]]
    assert sum(stored) == packed["stored_bytes"]
    effective = json.loads((root / "on" / "build_config.json").read_text())
    assert effective["compiler"]["enable_data_soft_compression"] is True
    console = Console(record=True, width=400, file=io.StringIO())  # what `pulsar info` prints
    for t in model_summary(out["on"].compiled_model):
        console.print(t)
    shown = console.export_text()
    assert f"weights in DDR {packed['raw_bytes']:,} -> {packed['stored_bytes']:,} bytes" in shown


def test_a_range_compresses_only_its_own_subgraph(builds) -> None:
    out, _ = builds
    meta = load_compiled(out["ranged"].compiled_model).metadata
    packed = meta["estimate"]["soft_compression"]
    assert len(packed["subgraphs"]) == 1 and packed["subgraphs"][0].endswith("_sub0")
    assert [x["layer"] for x in packed["layers"]] == ["dense_conv"]  # the range's layer, not sparse_conv


def test_soft_compression_does_not_change_results(builds) -> None:
    out, _ = builds
    sessions = {k: Session(v.compiled_model) for k, v in out.items()}
    for seed in range(3):
        x = {"x": np.random.default_rng(seed).standard_normal((1, 16, 8, 8)).astype(np.float32)}
        want = sessions["off"].run(x)
        for k in ("on", "ranged"):
            got = sessions[k].run(x)
            assert got.keys() == want.keys()
            for name in want:
                np.testing.assert_array_equal(got[name], want[name])
