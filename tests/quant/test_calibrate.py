"""One streaming calibration pass in onnxruntime, its cache, and ranges from the collected statistics."""

from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from pulsar.errors import PulsarError
from pulsar.quant import calibrate
from pulsar.quant.calibrate import (
    TensorStats,
    collect_statistics,
    compute_ranges,
    load_statistics,
)

SHAPE = [1, 3, 8, 8]
ACTIVATIONS = ["conv_out", "relu_out", "proj", "add_out"]
CHANNELS = {"conv_out": 4, "relu_out": 4, "proj": 3, "add_out": 3}


def _model(outputs: list[str] | None = None) -> onnx.ModelProto:
    """x -> Conv(3->4) -> Relu -> Conv1x1(4->3) -> Add(x); ``outputs`` picks the graph outputs."""
    rng = np.random.default_rng(7)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 3, 3, 3)).astype(np.float32), "W"),
        numpy_helper.from_array(rng.normal(0, 0.1, 4).astype(np.float32), "B"),
        numpy_helper.from_array(rng.normal(0, 0.5, (3, 4, 1, 1)).astype(np.float32), "W2"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "W", "B"], ["conv_out"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv_out"], ["relu_out"]),
        helper.make_node("Conv", ["relu_out", "W2"], ["proj"]),
        helper.make_node("Add", ["proj", "x"], ["add_out"]),
    ]
    outs = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, CHANNELS[n], 8, 8])
        for n in (outputs or ["add_out"])
    ]
    graph = helper.make_graph(
        nodes, "calib", [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)], outs, inits
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _samples(n: int = 6) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)  # growing scale: the histograms have to widen
    return [{"x": rng.normal(0.2 * k, 1.0 + k, SHAPE).astype(np.float32)} for k in range(n)]


class _MustNotIterate:
    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        raise AssertionError("the model was run although the statistics were cached")


NAMES = ["x", *ACTIVATIONS]


def test_statistics_match_direct_onnxruntime_runs() -> None:
    samples = _samples()
    stats = collect_statistics(_model(), NAMES, samples)
    assert list(stats) == NAMES
    for name in NAMES:
        if name == "x":
            data = np.concatenate([s["x"].ravel() for s in samples])
        else:  # the tensor as the only output of its own model, run separately
            sess = ort.InferenceSession(
                _model([name]).SerializeToString(), providers=["CPUExecutionProvider"]
            )
            data = np.concatenate([sess.run(None, s)[0].ravel() for s in samples])
        st = stats[name]
        assert (st.min, st.max) == (float(data.min()), float(data.max())), name
        assert st.count == data.size == int(st.hist.sum())
        assert st.zeros == int(np.sum(data == 0))
        ref, _ = np.histogram(data, bins=st.num_bins, range=(st.hist_lo, st.hist_hi))
        assert np.abs(ref - st.hist).sum() <= 2, name  # values on a bin edge may fall either way
    assert stats["relu_out"].min == 0.0 and stats["relu_out"].zeros > 0


def test_streaming_progress_and_one_sample_alive() -> None:
    alive: list[weakref.ref] = []
    seen: list[int] = []

    def generate() -> Iterator[dict[str, np.ndarray]]:
        rng = np.random.default_rng(3)
        for k in range(5):
            gc.collect()
            # the previous sample (and everything computed from it) is gone before the next is made
            assert all(r() is None for r in alive), f"sample {k - 1} still referenced"
            x = rng.normal(0, 1 + k, SHAPE).astype(np.float32)
            alive.append(weakref.ref(x))
            yield {"x": x}
            del x

    model = _model()
    before = model.SerializeToString()
    stats = collect_statistics(model, NAMES, generate(), progress=seen.append)
    assert seen == [1, 2, 3, 4, 5]
    assert stats["x"].count == 5 * int(np.prod(SHAPE))
    assert model.SerializeToString() == before  # the caller's model is not modified


def test_cache_hit_returns_identical_stats_without_running(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="pulsar")
    first = collect_statistics(_model(), NAMES, _samples(), cache_dir=tmp_path, cache_key="abc123")
    cache = tmp_path / "calib_stats_abc123.npz"
    assert cache.is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # atomic write cleaned up
    with np.load(cache, allow_pickle=False) as data:
        assert all(data[k].dtype.kind != "O" for k in data.files)

    caplog.clear()
    again = collect_statistics(_model(), NAMES, _MustNotIterate(), cache_dir=tmp_path, cache_key="abc123")
    assert "cache hit" in caplog.text
    assert list(again) == list(first)
    for name in NAMES:
        assert isinstance(again[name], TensorStats) and again[name] == first[name]
    assert load_statistics(cache) == {n: first[n] for n in NAMES}
    # a subset of the cached tensors is a hit as well
    sub = collect_statistics(_model(), ["proj"], _MustNotIterate(), cache_dir=tmp_path, cache_key="abc123")
    assert list(sub) == ["proj"] and sub["proj"] == first["proj"]


def test_cache_miss_runs_the_model(tmp_path: Path) -> None:
    collect_statistics(_model(), ["x", "proj"], _samples(2), cache_dir=tmp_path, cache_key="k")
    with pytest.raises(AssertionError, match="was run"):  # a tensor the cache lacks: recompute
        collect_statistics(_model(), ["x", "relu_out"], _MustNotIterate(), cache_dir=tmp_path, cache_key="k")
    with pytest.raises(AssertionError, match="was run"):  # another key
        collect_statistics(_model(), ["x"], _MustNotIterate(), cache_dir=tmp_path, cache_key="other")
    cache = tmp_path / "calib_stats_k.npz"
    cache.write_bytes(b"not an npz file")  # corrupt: recomputed and rewritten
    stats = collect_statistics(_model(), ["proj"], _samples(2), cache_dir=tmp_path, cache_key="k")
    assert load_statistics(cache)["proj"] == stats["proj"]


def test_models_too_large_for_one_protobuf_go_through_a_file(monkeypatch: pytest.MonkeyPatch) -> None:
    direct = collect_statistics(_model(), NAMES, _samples(2))
    monkeypatch.setattr(calibrate, "_PROTO_LIMIT", 0)  # treat the tiny model as if it were > 2 GiB
    via_file = collect_statistics(_model(), NAMES, _samples(2))
    assert all(via_file[n] == direct[n] for n in NAMES)


def test_initializers_are_skipped() -> None:
    stats = collect_statistics(_model(), ["W", "relu_out"], _samples(2))
    assert list(stats) == ["relu_out"]


def test_user_errors_are_pulsar_errors() -> None:
    with pytest.raises(PulsarError, match=r"'relu_outt' is not in the model \(did you mean \"relu_out\"\?\)"):
        collect_statistics(_model(), ["relu_outt"], _samples(1))
    with pytest.raises(PulsarError, match=r"input 'x' has no data \(the sample has 'X'"):
        collect_statistics(_model(), NAMES, [{"X": _samples(1)[0]["x"]}])
    with pytest.raises(PulsarError, match=r"input 'x' has shape 1x3x4x4, the model expects 1x3x8x8"):
        collect_statistics(_model(), NAMES, [{"x": np.zeros((1, 3, 4, 4), np.float32)}])
    with pytest.raises(PulsarError, match="no samples"):
        collect_statistics(_model(), NAMES, [])


def test_onnxruntime_failures_are_pulsar_errors() -> None:
    broken = _model()
    broken.graph.node.append(helper.make_node("NoSuchOp", ["add_out"], ["odd"], domain="pulsar.test"))
    broken.opset_import.append(helper.make_opsetid("pulsar.test", 1))
    with pytest.raises(PulsarError, match="onnxruntime cannot load the float model"):
        collect_statistics(broken, ["relu_out"], _samples(1))
    dynamic = _model()
    for dim, name in zip(dynamic.graph.input[0].type.tensor_type.shape.dim, "NCHW", strict=True):
        dim.dim_param = name  # no static dims: a wrong channel count reaches onnxruntime
    with pytest.raises(PulsarError, match="calibration sample 1: onnxruntime failed"):
        collect_statistics(dynamic, ["relu_out"], [{"x": np.zeros((1, 2, 8, 8), np.float32)}])


def test_feed_dtype_is_converted() -> None:
    samples = [{"x": s["x"].astype(np.float64)} for s in _samples(2)]
    stats = collect_statistics(_model(), ["x", "add_out"], samples)
    assert stats["x"].max == float(np.max([s["x"].astype(np.float32).max() for s in samples]))


def test_compute_ranges_for_all_methods() -> None:
    stats = collect_statistics(_model(), NAMES, _samples())
    for method in ("MinMax", "Percentile", "MSE", "KL"):
        for symmetric in (False, True):
            ranges = compute_ranges(stats, method, symmetric=symmetric, signed=symmetric)
            assert list(ranges) == NAMES
            for name, (lo, hi) in ranges.items():
                assert lo <= 0.0 <= hi and hi > lo, (method, name)
                assert lo >= min(stats[name].min, -stats[name].max) - 1e-6
            assert ranges["relu_out"][0] == (-ranges["relu_out"][1] if symmetric else 0.0)
    minmax = compute_ranges(stats, "MinMax")
    assert minmax["proj"] == (min(stats["proj"].min, 0.0), max(stats["proj"].max, 0.0))
    with pytest.raises(PulsarError, match="quant.calibration_method"):
        compute_ranges({}, "Entropy")


def test_counting_threads_change_no_statistic(monkeypatch):
    """One sample's activations are counted by two threads (each tensor by one of them): the statistics
    equal those of one thread, tensor by tensor, histogram bin by bin."""
    samples = _samples(6)
    by_threads = {}
    for threads in (1, 2):
        monkeypatch.setattr(calibrate, "_HIST_THREADS", threads)
        by_threads[threads] = collect_statistics(_model(), ["x", *ACTIVATIONS], samples)
    one, two = by_threads[1], by_threads[2]
    assert set(one) == set(two) == {"x", *ACTIVATIONS}
    assert all(one[name] == two[name] for name in one)
    assert one["relu_out"].count == 6 * 4 * 64 and one["relu_out"].hist.sum() == one["relu_out"].count


def test_a_build_imports_torch_only_when_it_needs_it():
    """torch costs a build 2-3 s of CPU and ~140 MB of peak memory while the calibration activations
    are alive: the build's modules load without it (the compile step's simulator check imports it)."""
    import subprocess
    import sys

    code = ("import sys, pulsar.api, pulsar.cli, pulsar.preflight, pulsar.quant.stage, pulsar.quant.calibrate, "
            "pulsar.frontend.stage; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _movement_model() -> onnx.ModelProto:
    """x -> Relu -> Transpose -> Reshape -> Sigmoid -> y, and a second output: a Flatten of the Relu."""
    shape_t = numpy_helper.from_array(np.array([1, 8, 24], np.int64), "shape")
    nodes = [
        helper.make_node("Relu", ["x"], ["relu"]),
        helper.make_node("Transpose", ["relu"], ["perm"], perm=[0, 2, 3, 1]),
        helper.make_node("Reshape", ["perm", "shape"], ["flat"]),
        helper.make_node("Sigmoid", ["flat"], ["y"]),
        helper.make_node("Flatten", ["relu"], ["side"]),
    ]
    graph = helper.make_graph(
        nodes, "moves", [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 24]),
         helper.make_tensor_value_info("side", TensorProto.FLOAT, [1, 192])], [shape_t])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_permutations_copy_the_statistics_of_their_source(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Transpose / Reshape output holds its input's values: its statistics are a copy of the input's
    (equal to measuring it), it is not exposed, and graph outputs and tensors whose source is not
    collected are still measured."""
    model, samples = _movement_model(), _samples()
    names = ["relu", "perm", "flat", "y", "side"]
    assert calibrate._permutations(model, names, set(names), 0) == {"perm": "relu", "flat": "relu"}
    assert calibrate._permutations(model, ["perm", "flat"], {"perm", "flat"}, 0) == {"flat": "perm"}
    fetched: list[list[str]] = []
    real = calibrate._session

    def spy(m: onnx.ModelProto, fetch: list[str], overlap: bool = False):
        fetched.append(list(fetch))
        return real(m, fetch, overlap)

    monkeypatch.setattr(calibrate, "_session", spy)
    stats = collect_statistics(model, names, samples)
    assert fetched == [["relu", "y", "side"]]  # the Flatten output is a graph output: measured
    assert stats["perm"] == stats["relu"] and stats["flat"] == stats["relu"]
    assert stats["perm"] is not stats["relu"]  # a copy: a later merge into one leaves the other
    # equal to what measuring them gives: each tensor the only output of its own run
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for name in ("perm", "flat"):
        measured = TensorStats.empty()
        exposed = onnx.ModelProto()
        exposed.CopyFrom(model)
        exposed.graph.output.extend([onnx.ValueInfoProto(name=name)])
        run = ort.InferenceSession(exposed.SerializeToString(), providers=["CPUExecutionProvider"])
        for s in samples:
            measured.update(run.run([name], s)[0])
        assert stats[name] == measured, name
    assert sess.run(["side"], samples[0])[0].size == stats["side"].count // len(samples)


@pytest.mark.parametrize("cap", [50, 1000])
def test_sampled_histograms_copy_only_what_measuring_gives(cap: int) -> None:
    """With histograms of a sample (every k-th value in flat order) a Reshape still gives the same
    numbers as its input, a Transpose (which reorders) only when its tensor is binned whole: above the
    cap it is measured, and each copy equals measuring the tensor on its own."""
    model = onnx.shape_inference.infer_shapes(_movement_model())
    names = ["relu", "perm", "flat", "y"]
    aliases = calibrate._permutations(model, names, set(names), cap)
    assert aliases == ({"perm": "relu", "flat": "relu"} if cap >= 192 else {"flat": "perm"})
    samples = _samples()
    stats = collect_statistics(model, names, samples, sample_cap=cap)
    for name in ("perm", "flat"):
        exposed = onnx.ModelProto()
        exposed.CopyFrom(model)
        exposed.graph.output.extend([onnx.ValueInfoProto(name=name)])
        run = ort.InferenceSession(exposed.SerializeToString(), providers=["CPUExecutionProvider"])
        measured = TensorStats.empty(sample_cap=cap)
        for s in samples:
            measured.update(run.run([name], s)[0])
        assert stats[name] == measured, name
