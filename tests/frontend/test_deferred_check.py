"""The frontend's check of its optimized graph, settled in the quant stage with the outputs the
calibration pass computes anyway; the compiled model checked from the bytes still being written."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
from frontend_graphs import conv_bn_model
from onnx import numpy_helper

import pulsar
from pulsar.core.container import load_compiled
from pulsar.errors import PulsarError
from pulsar.frontend import pass_manager
from pulsar.frontend.check import random_samples
from pulsar.frontend.passes import DEFAULT_PASSES, PASSES, register_pass
from pulsar.quant.calibrate import Reference
from pulsar.quant.stage import _kept_outputs
from pulsar.utils import atomic


@pytest.fixture
def broken_pass():
    """A pass with a bug: it scales the first Conv weight by 1.01 (once)."""

    @register_pass("scale_conv_weight_once_bug")
    def scale_conv_weight_once_bug(model: onnx.ModelProto) -> bool:
        inits = {t.name: t for t in model.graph.initializer}
        for node in model.graph.node:
            if node.op_type == "Conv" and not node.name.endswith("_scaled"):
                weight = inits[node.input[1]]
                weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) * 1.01, weight.name))
                node.name += "_scaled"
                return True
        return False

    yield "scale_conv_weight_once_bug"
    del PASSES["scale_conv_weight_once_bug"]


def test_settle_trusts_the_outputs_it_is_given_and_runs_the_graph_without_them(broken_pass):
    model = conv_bn_model()
    optimized, _, pending = pass_manager.optimize_deferred(model, [*DEFAULT_PASSES, broken_pass])
    assert pending is not None and pending.model is optimized
    assert pending.settle(pending.ref) is None  # the input graph's own outputs: nothing to find
    with pytest.raises(PulsarError, match=f'after frontend pass "{broken_pass}"'):
        pending.settle()


def test_settle_replays_when_the_given_outputs_differ_and_no_pass_explains_it():
    model = conv_bn_model()
    optimized, _, pending = pass_manager.optimize_deferred(model)
    assert pending is not None
    off = [{k: v + 1.0 for k, v in r.items()} for r in pending.ref]
    replayed = pending.settle(off)
    assert replayed is not None  # every pass checked alone: none differs, the graph stands
    assert replayed[0].graph.node[0].op_type == optimized.graph.node[0].op_type
    assert any(r.changed_iterations for r in replayed[1].values())


def test_no_pending_check_without_a_change_or_without_the_check():
    model = conv_bn_model()
    optimized, _, pending = pass_manager.optimize_deferred(model)
    assert pass_manager.optimize_deferred(optimized)[2] is None  # nothing changed: nothing to check
    assert pass_manager.optimize_deferred(model, check=False)[2] is None


def test_kept_outputs_only_for_the_same_inputs():
    samples = random_samples(conv_bn_model(), count=2)
    ref = Reference(["y"], 8)
    for s in samples:
        ref.keep(s, ["y"], [np.ones(3, np.float32)])
    assert _kept_outputs(ref, samples, ["y"]) == ref.outputs[:2]
    other = [dict(samples[0]), {"x": samples[1]["x"] + 1}]  # a data set that streams other samples
    assert _kept_outputs(ref, other, ["y"]) is None
    assert _kept_outputs(ref, samples, ["y", "cls"]) is None  # an output the pass did not fetch (int64)
    assert _kept_outputs(Reference(["y"], 8), samples, ["y"]) is None  # nothing kept (statistics from the cache)
    assert _kept_outputs(None, samples, ["y"]) is None


def _count_runs(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = pass_manager.run

    def counted(model, samples):
        calls.append(len(model.graph.node))
        return real(model, samples)

    monkeypatch.setattr(pass_manager, "run", counted)
    return calls


def test_a_build_checks_its_optimized_graph_with_the_calibration_outputs(tmp_path, tiny, tiny_config, monkeypatch):
    calls = _count_runs(monkeypatch)
    pulsar.build(tiny["model"], tmp_path / "out", tiny_config, quiet=True)
    assert len(calls) == 1  # the input graph only: the calibration pass ran the optimized one
    # the statistics now come from the cache, no float pass: the check runs the optimized graph itself
    pulsar.build(tiny["model"], tmp_path / "out", tiny_config, quiet=True)
    assert len(calls) == 3 and calls[2] < calls[1]


def test_a_build_names_the_broken_pass_and_writes_nothing(tmp_path, tiny, tiny_config, monkeypatch, broken_pass):
    monkeypatch.setattr(pass_manager, "DEFAULT_PASSES", [*DEFAULT_PASSES, broken_pass])
    out = tmp_path / "out"
    with pytest.raises(PulsarError, match=f'transformation check failed after frontend pass "{broken_pass}"'):
        pulsar.build(tiny["model"], out, tiny_config, quiet=True)
    assert not out.exists() or not [p for p in out.rglob("*") if p.suffix in (".onnx", ".pulsar")]


def test_the_compiled_model_loads_from_the_bytes_in_flight(tmp_path, tiny, tiny_config, monkeypatch):
    res = pulsar.build(tiny["model"], tmp_path / "out", tiny_config, quiet=True)
    data = Path(res.compiled_model).read_bytes()
    gate = threading.Event()
    real = atomic.atomic_path

    def held(path):
        gate.wait(10)
        return real(path)

    monkeypatch.setattr(atomic, "atomic_path", held)
    target = tmp_path / "copy" / "compiled.pulsar"
    with atomic.background_writes():
        atomic.atomic_write_bytes(target, data, background=True)
        assert not target.exists()
        compiled = load_compiled(target)  # the checksum and structure checks on the pending bytes
        assert compiled.subgraphs and compiled.checksum
        gate.set()
    assert target.read_bytes() == data


@pytest.fixture
def unrunnable_pass():
    """A pass with a bug that leaves a graph onnxruntime cannot run: the Gemm's weight read untransposed."""

    @register_pass("gemm_transpose_bug")
    def gemm_transpose_bug(model: onnx.ModelProto) -> bool:
        for node in model.graph.node:
            for attr in node.attribute:
                if node.op_type == "Gemm" and attr.name == "transB" and attr.i == 1:
                    attr.i = 0
                    return True
        return False

    yield "gemm_transpose_bug"
    del PASSES["gemm_transpose_bug"]


def test_a_pass_that_breaks_the_graph_is_named_before_the_calibration_error(tmp_path, tiny, tiny_config,
                                                                           monkeypatch, unrunnable_pass):
    monkeypatch.setattr(pass_manager, "DEFAULT_PASSES", [*DEFAULT_PASSES, unrunnable_pass])
    with pytest.raises(PulsarError, match=f'after frontend pass "{unrunnable_pass}" onnxruntime cannot run'):
        pulsar.build(tiny["model"], tmp_path / "out", tiny_config, quiet=True)


def test_with_smooth_quant_the_check_is_settled_before_the_graph_changes(tmp_path, tiny, tiny_config, monkeypatch,
                                                                        unrunnable_pass):
    monkeypatch.setattr(pass_manager, "DEFAULT_PASSES", [*DEFAULT_PASSES, unrunnable_pass])
    with pytest.raises(PulsarError, match=f'after frontend pass "{unrunnable_pass}" onnxruntime cannot run'):
        pulsar.build(tiny["model"], tmp_path / "out", tiny_config, {"quant.enable_smooth_quant": True}, quiet=True)


def test_an_output_the_calibration_pass_does_not_fetch_is_checked_by_running_the_graph(tmp_path, tiny, tiny_config,
                                                                                      monkeypatch):
    model = onnx.load(tiny["model"])  # a second output of type int64: calibration fetches float tensors only
    model.graph.node.append(onnx.helper.make_node("ArgMax", ["logits"], ["cls"], name="argmax", axis=1))
    model.graph.output.append(onnx.helper.make_tensor_value_info("cls", onnx.TensorProto.INT64, [1, 1]))
    path = tmp_path / "two_outputs.onnx"
    onnx.save(model, path)
    calls = _count_runs(monkeypatch)
    pulsar.build(path, tmp_path / "out", tiny_config, quiet=True)
    assert len(calls) == 2  # the input graph, then the optimized one: no replay of the passes
    assert "replaying the passes" not in (tmp_path / "out" / "build.log").read_text()


def test_a_check_holding_large_samples_is_settled_in_the_frontend(tmp_path, tiny, tiny_config, monkeypatch):
    from pulsar.frontend import stage

    calls = _count_runs(monkeypatch)
    monkeypatch.setattr(stage, "DEFER_BYTES", 0)  # every check's samples and outputs count as large
    pulsar.build(tiny["model"], tmp_path / "out", tiny_config, quiet=True)
    assert len(calls) == 2 and calls[1] < calls[0]  # the optimized graph ran for its own check
