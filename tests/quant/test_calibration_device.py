"""Calibration on ``quant.device``: the torch float pass and the device-side statistics.

The GPU runs the same code as ``backend="torch"`` on CPU, so CI (no GPU) checks the torch pass against
onnxruntime on real models; the CUDA tests at the end run where a GPU is present."""

from __future__ import annotations

import json
import logging
import weakref
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import pulsar
from pulsar.errors import PulsarError
from pulsar.quant.calibrate import collect_statistics, compute_ranges
from pulsar.quant.observers.histogram import _CHUNK, TensorStats
from pulsar.quant.observers.torch_stats import update_torch
from pulsar.quant.stage import calibration_tensors
from pulsar.quant.torch_exec.float_pass import FloatPass
from tests.hostile.harness import Snapshot, assert_clean_failure, run_cli

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


# ------------------------------------------------------------------------------- device statistics
def _batches(rng: np.random.Generator) -> list[np.ndarray]:
    """Growing grids (both sides, one side), NaN / Inf, exact zeros, a constant first batch, odd dtypes."""
    out: list[np.ndarray] = [np.full((7, 5), 0.25, np.float32)]  # constant: the grid restarts later
    for k in range(12):
        x = rng.normal(0.4 * k, 1.0 + k * k, (3, 97, 11)).astype(np.float32)
        x[0, :4, 0] = 0.0
        x[0, 4, 0] = -0.0
        if k % 3 == 0:
            x[1, :3, 0] = [np.nan, np.inf, -np.inf]
        out.append(x)
    out.append(np.array([np.nan, np.inf], np.float32))  # nothing finite
    out.append(np.zeros((0, 3), np.float32))  # empty
    out.append(rng.normal(0, 1e3, 500).astype(np.float16))  # narrower than float32: binned in float32
    out.append(rng.integers(-50, 300, (4, 9)).astype(np.int64))  # integers: float32
    out.append(rng.normal(-3, 2e4, 999))  # float64 stays float64
    out.append(np.array([1e35, -2e35, 0.0], np.float32))  # degenerate scale: the float64 branch
    return out


@pytest.mark.parametrize("num_bins", [16, 2048])
def test_torch_update_equals_the_numpy_update_bit_for_bit(num_bins: int) -> None:
    rng = np.random.default_rng(3)
    ref, dev = TensorStats.empty(num_bins), TensorStats.empty(num_bins)
    for k, x in enumerate(_batches(rng)):
        ref.update(x)
        update_torch(dev, torch.from_numpy(x.copy()))
        assert dev == ref, f"batch {k}: {dev} != {ref}"
    assert ref.nonfinite > 0 and ref.zeros >= 5 and ref.count > 10_000


def test_torch_update_bins_large_tensors_in_chunks_like_numpy() -> None:
    x = np.random.default_rng(5).standard_t(3, _CHUNK + 12_345).astype(np.float32)
    ref, dev = TensorStats.empty(), TensorStats.empty()
    ref.update(x[:1000])
    update_torch(dev, torch.from_numpy(x[:1000].copy()))
    ref.update(x)
    update_torch(dev, torch.from_numpy(x))
    assert dev == ref and dev.count == x.size + 1000


def test_torch_update_takes_the_same_sample_as_numpy() -> None:
    """Past ``sample_cap`` both updates bin the same weighted strided sample (offsets moving with each
    batch), NaN / Inf removed first, and count its zeros alike."""
    rng = np.random.default_rng(8)
    ref, dev = TensorStats.empty(sample_cap=1000), TensorStats.empty(sample_cap=1000)
    for k in range(5):
        x = rng.normal(0, 1 + k, 4321 + 77 * k).astype(np.float32)
        x[::5] = 0.0
        x[7] = np.nan
        ref.update(x)
        update_torch(dev, torch.from_numpy(x))
        assert dev == ref, f"batch {k}"
    assert ref.binned(4321)[1] == 5 and ref.zeros > 0 and int(ref.hist.sum()) == ref.count


# ------------------------------------------------------------------------------ the torch float pass
def _tiny(tiny: dict[str, Path]) -> tuple[onnx.ModelProto, list[dict[str, np.ndarray]]]:
    model = onnx.shape_inference.infer_shapes(onnx.load(tiny["model"]))
    samples = [{"image": np.load(p)} for p in sorted(Path(tiny["calib"]).glob("*.npy"))]
    return model, samples


def _assert_close(torch_stats: dict[str, TensorStats], ort_stats: dict[str, TensorStats]) -> None:
    assert set(torch_stats) == set(ort_stats)
    for name, ref in ort_stats.items():
        got = torch_stats[name]
        tol = 1e-5 * max(abs(ref.min), abs(ref.max), 1e-6)
        assert got.count == ref.count and got.nonfinite == ref.nonfinite, name
        assert abs(got.min - ref.min) <= tol and abs(got.max - ref.max) <= tol, (name, got.min, ref.min, got.max,
                                                                                 ref.max)
        assert abs(got.zeros - ref.zeros) <= 0.001 * ref.count, name
        if got.hist_lo == ref.hist_lo and got.hist_hi == ref.hist_hi:  # same grid: counts differ by rounding only
            assert np.abs(got.hist - ref.hist).sum() <= 0.002 * ref.count, name
    for method in ("MinMax", "Percentile", "KL", "MSE"):
        a, b = compute_ranges(torch_stats, method), compute_ranges(ort_stats, method)
        for name in a:
            scale = max(abs(b[name][0]), abs(b[name][1]), 1e-6)
            assert np.allclose(a[name], b[name], atol=2e-3 * scale), (method, name, a[name], b[name])


def test_torch_pass_matches_onnxruntime_on_the_tiny_cnn(tiny: dict[str, Path],
                                                        caplog: pytest.LogCaptureFixture) -> None:
    model, samples = _tiny(tiny)
    names = calibration_tensors(model)
    assert len(names) >= 10
    with caplog.at_level(logging.INFO, logger="pulsar.quant.calibrate"):
        via_ort = collect_statistics(model, names, samples)
        via_torch = collect_statistics(model, names, samples, backend="torch")
    _assert_close(via_torch, via_ort)
    assert via_torch["image"] == via_ort["image"]  # the input is the same data: identical statistics
    logs = [r.getMessage() for r in caplog.records if "calibration statistics:" in r.getMessage()]
    assert logs[0].endswith(" on cpu") and logs[1].endswith(" on cpu (torch)"), logs
    assert f"{len(names)} tensors over {len(samples)} samples" in logs[1]


def _odd_model() -> onnx.ModelProto:
    """An If with a subgraph reading an outer tensor, a com.microsoft op torch lacks, and a Constant."""
    then_g = helper.make_graph([helper.make_node("Mul", ["r", "k"], ["t_out"])], "then", [],
                               [helper.make_tensor_value_info("t_out", TensorProto.FLOAT, None)])
    else_g = helper.make_graph([helper.make_node("Neg", ["r"], ["e_out"])], "else", [],
                               [helper.make_tensor_value_info("e_out", TensorProto.FLOAT, None)])
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.array(3.0, np.float32))),
        helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["cond"]),
        helper.make_node("If", ["cond"], ["branch"], then_branch=then_g, else_branch=else_g),
        helper.make_node("Inverse", ["branch"], ["inv"], domain="com.microsoft"),
        helper.make_node("Add", ["inv", "x"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "odd", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 3])],
                              [numpy_helper.from_array(np.array(0.0, np.float32), "zero")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=8)  # onnx's newest IR version can be past what onnxruntime reads


def test_subgraphs_constants_and_ops_torch_lacks(caplog: pytest.LogCaptureFixture) -> None:
    rng = np.random.default_rng(2)
    samples = [{"x": (rng.normal(0, 1, (2, 3, 3)) + 3 * np.eye(3) * (1 if k % 2 else -1)).astype(np.float32)}
               for k in range(6)]
    names = ["x", "r", "k", "s", "branch", "inv", "y"]
    with caplog.at_level(logging.WARNING):
        via_torch = collect_statistics(_odd_model(), names, samples, backend="torch")
    warned = [r.getMessage() for r in caplog.records if "Inverse" in r.getMessage()]
    assert warned and "onnxruntime" in warned[0] and "quant.device cpu" in warned[0]
    via_ort = collect_statistics(_odd_model(), names, samples)
    _assert_close(via_torch, via_ort)
    assert via_torch["k"].count == 6 and via_torch["k"].min == via_torch["k"].max == 3.0  # once per sample


def test_a_tensor_lives_only_while_a_later_node_reads_it() -> None:
    """A chain of 12 ops whose tensors are all calibrated: the pass never holds more than a few."""
    nodes = [helper.make_node("Relu" if i % 2 else "Neg", [f"t{i}"], [f"t{i + 1}"]) for i in range(12)]
    nodes.append(helper.make_node("Add", ["t12", "t0"], ["out"]))  # the input is read at the end again
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("t0", TensorProto.FLOAT, [64])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [64])])
    runner = FloatPass(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    seen: list[weakref.ref[torch.Tensor]] = []
    most_alive = 0

    def sink(name: str, value: torch.Tensor) -> None:
        nonlocal most_alive
        seen.append(weakref.ref(value))
        most_alive = max(most_alive, sum(r() is not None for r in seen))

    x = torch.randn(64)
    runner.stream({"t0": x}, [f"t{i}" for i in range(1, 13)] + ["out"], sink)
    assert len(seen) == 13 and most_alive <= 2  # the one being counted and its producer's input


def test_torch_statistics_are_cached_apart_from_onnxruntime_ones(tiny: dict[str, Path], tmp_path: Path) -> None:
    model, samples = _tiny(tiny)
    names = calibration_tensors(model)[:4]
    collect_statistics(model, names, samples[:2], cache_dir=tmp_path, cache_key="k")
    collect_statistics(model, names, samples[:2], cache_dir=tmp_path, cache_key="k", backend="torch")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib_stats_k-torchcpu.npz", "calib_stats_k.npz"]


def test_bad_inputs_fail_the_same_way_on_the_torch_pass(tiny: dict[str, Path]) -> None:
    model, samples = _tiny(tiny)
    with pytest.raises(PulsarError, match=r"calibration sample 1: input 'image' has shape 1x3x8x8"):
        collect_statistics(model, ["c1"], [{"image": np.zeros((1, 3, 8, 8), np.float32)}], backend="torch")
    with pytest.raises(PulsarError, match="yielded no samples"):
        collect_statistics(model, ["c1"], [], backend="torch")


def test_a_cuda_device_without_cuda_fails_before_anything_is_written(tiny: dict[str, Path], tmp_path: Path) -> None:
    """quant.device acts without fine-tuning now (calibration runs there): preflight checks it."""
    if CUDA:
        pytest.skip("this machine has CUDA")
    cfg = {"quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                                        "calibration_format": "Numpy"}]}}
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    before = Snapshot.of(tmp_path)
    proc = run_cli(["build", "--input", str(tiny["model"]), "--config", "c.json", "--output_dir", "out",
                    "--quant.device", "cuda:0"], tmp_path)
    assert_clean_failure(proc, ("quant.device", "cuda:0", "CUDA"), before, tmp_path)


# ------------------------------------------------------------------------------------ on a CUDA GPU
@needs_cuda
def test_cuda_update_equals_the_numpy_update_bit_for_bit() -> None:
    rng = np.random.default_rng(3)
    ref, dev = TensorStats.empty(), TensorStats.empty()
    for k, x in enumerate(_batches(rng)):
        ref.update(x)
        update_torch(dev, torch.from_numpy(x.copy()).cuda())
        assert dev == ref, f"batch {k}"


@needs_cuda
def test_cuda_pass_matches_onnxruntime(tiny: dict[str, Path]) -> None:
    model, samples = _tiny(tiny)
    names = calibration_tensors(model)
    _assert_close(collect_statistics(model, names, samples, device="cuda:0"), collect_statistics(model, names, samples))


@needs_cuda
def test_cuda_build_matches_the_cpu_build(tiny: dict[str, Path], tmp_path: Path) -> None:
    def build(out: Path, device: str) -> dict[str, list[float]]:
        cfg = {"quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                                            "calibration_format": "Numpy", "calibration_size": 8}],
                         "device": device}}
        pulsar.build(input=tiny["model"], output_dir=out, config=cfg, quiet=True)
        tensors = json.loads((out / "quant" / "quant_config.json").read_text())["tensors"]
        return {k: v["scale"] for k, v in tensors.items()}

    gpu = build(tmp_path / "gpu", "cuda:0")
    assert len(list((tmp_path / "gpu").rglob("calib_stats_*-torchcuda.npz"))) == 1  # the statistics came from the GPU
    cpu = build(tmp_path / "cpu", "cpu")
    assert set(gpu) == set(cpu)
    for name in cpu:
        assert np.allclose(gpu[name], cpu[name], rtol=1e-3), (name, gpu[name], cpu[name])
