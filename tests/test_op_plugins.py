"""Operator plugins (pulsar.plugins): a model with a custom op builds, runs and fine-tunes.

The model is MatMul -> my.ops:ClampScale (attributes lo / hi / scale) -> MatMul; the plugin file is
written into tmp_path and named in ``op_plugins``; the float reference is numpy."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import pulsar
from pulsar.core import custom_ops, opdefs
from pulsar.core.container import load_compiled
from pulsar.core.plugin_session import PluginSession, inference_session
from pulsar.errors import PulsarError
from tests.cli_fork import run_pulsar

LO, HI, SCALE = -0.5, 1.0, 2.0
RNG = np.random.default_rng(0)
W1 = (RNG.standard_normal((16, 16)) * 0.4).astype(np.float32)
W2 = (RNG.standard_normal((16, 8)) * 0.4).astype(np.float32)

PLUGIN = '''
import numpy as np
from pulsar.plugins import register_op

CALLS = []

@register_op("my.ops", "ClampScale")
def clamp_scale(x, *, lo=-1.0, hi=1.0, scale=1.0):
    CALLS.append(x.shape)
    return np.clip(x, lo, hi) * scale
'''

TORCH_PLUGIN = PLUGIN + '''

def _torch(x, *, lo=-1.0, hi=1.0, scale=1.0):
    import torch
    return torch.clamp(x, lo, hi) * scale

register_op("my.ops", "ClampScale", clamp_scale, torch_forward=_torch)
'''


def reference(x: np.ndarray) -> np.ndarray:
    return np.clip(x @ W1, LO, HI) * SCALE @ W2


def make_model(path: Path, op_type: str = "ClampScale", domain: str = "my.ops") -> Path:
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node(op_type, ["h"], ["c"], name="clamp", domain=domain, lo=LO, hi=HI, scale=SCALE),
             helper.make_node("MatMul", ["c", "w2"], ["y"], name="mm2")]
    graph = helper.make_graph(nodes, "plugin", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8])],
                              initializer=[numpy_helper.from_array(W1, "w1"), numpy_helper.from_array(W2, "w2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


@pytest.fixture(autouse=True)
def _forget_plugins() -> Iterator[None]:
    """Each test loads its own plugin; none stays registered for the tests after it."""
    yield
    for domain, op_type in list(custom_ops.CUSTOM_OPS):
        custom_ops.unregister_op(domain, op_type)


@pytest.fixture()
def case(tmp_path: Path) -> dict[str, Path]:
    calib = tmp_path / "calib"
    calib.mkdir()
    for i in range(8):
        np.save(calib / f"{i}.npy", np.random.default_rng(i).standard_normal((1, 4, 16)).astype(np.float32))
    plugin = tmp_path / "my_ops.py"
    plugin.write_text(PLUGIN)
    return {"model": make_model(tmp_path / "m.onnx"), "calib": calib, "plugin": plugin, "root": tmp_path}


def config(case: dict[str, Path], **quant: object) -> dict:
    return {"op_plugins": [str(case["plugin"])],
            "quant": {"input_configs": [{"tensor_name": "x", "calibration_dataset": str(case["calib"]),
                                         "calibration_format": "Numpy"}], **quant}}


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a.ravel(), b.ravel()) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_a_model_with_a_plugin_op_builds_and_runs_in_both_modes(case: dict[str, Path]) -> None:
    res = pulsar.build(case["model"], case["root"] / "out", config(case), quiet=True)
    node = json.loads(res.quant_config.read_text())["nodes"]["clamp"]
    assert node["placement"] == "CPU" and "my_ops.py" in json.dumps(node), node
    compiled = load_compiled(res.compiled_model)
    assert compiled.metadata["op_plugins"] == [{"domain": "my.ops", "op_type": "ClampScale",
                                                "file": str(case["plugin"].resolve())}]
    cpu_ops = {n.op_type for sg in compiled.subgraphs if sg.kind == "cpu" for n in sg.graph.node}
    assert "ClampScale" in cpu_ops
    x = np.random.default_rng(42).standard_normal((1, 4, 16)).astype(np.float32)
    ref = reference(x)
    for mode in ("NPUBackend", "Reference"):
        y = pulsar.Session(res.compiled_model, mode=mode).run({"x": x})["y"]
        assert y.shape == ref.shape and cosine(y, ref) > 0.995, (mode, cosine(y, ref))
    # the float model in the split session is the numpy reference exactly (up to float32 rounding)
    sess = inference_session(onnx.load(res.optimized_model))
    assert isinstance(sess, PluginSession)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], ref, rtol=1e-5, atol=1e-5)


def test_pulsar_run_loads_the_recorded_plugin_or_the_given_one(case: dict[str, Path]) -> None:
    res = pulsar.build(case["model"], case["root"] / "out", config(case), quiet=True)
    env = {**os.environ, "COLUMNS": "200"}

    def run(*extra: str) -> subprocess.CompletedProcess:
        return run_pulsar(["run", "--model", str(res.compiled_model), "--random_input",
                          "--output_dir", str(case["root"] / "run"), *extra], timeout=120, env=env)

    ok = run()  # the plugin file the build recorded
    assert ok.returncode == 0, ok.stderr
    assert np.load(case["root"] / "run" / "y.npy").shape == (1, 4, 8)
    moved = case["root"] / "elsewhere.py"
    case["plugin"].rename(moved)
    gone = run()
    assert gone.returncode == 2
    assert "my.ops:ClampScale" in gone.stderr and "--op_plugin" in gone.stderr and len(gone.stderr.splitlines()) == 1
    given = run("--op_plugin", str(moved))
    assert given.returncode == 0, given.stderr


def test_fine_tuning_runs_through_a_plugin_op(case: dict[str, Path]) -> None:
    case["plugin"].write_text(TORCH_PLUGIN)
    cfg = config(case, enable_adaround=True, finetune_epochs=2, finetune_batch_size=4)
    res = pulsar.build(case["model"], case["root"] / "out", cfg, quiet=True)
    op = custom_ops.lookup("my.ops", "ClampScale")
    assert op is not None and op.torch_forward is not None
    x = np.random.default_rng(7).standard_normal((1, 4, 16)).astype(np.float32)
    y = pulsar.Session(res.compiled_model).run({"x": x})["y"]
    assert cosine(y, reference(x)) > 0.99


def test_torch_executor_calls_the_plugin_with_and_without_gradient(case: dict[str, Path]) -> None:
    import torch

    from pulsar.quant.finetune.gradient import passes_gradient
    from pulsar.quant.torch_exec.fallback import PluginNode, node_runner

    custom_ops.load_plugins([case["plugin"]], "op_plugins")
    node = onnx.load(case["model"]).graph.node[1]
    runner = node_runner(node, [])
    assert isinstance(runner, PluginNode) and not passes_gradient(node)
    x = torch.linspace(-2, 2, 9, requires_grad=True)
    out = runner([x])[0]
    np.testing.assert_allclose(out.numpy(), np.clip(np.linspace(-2, 2, 9), LO, HI) * SCALE, rtol=1e-6)
    assert not out.requires_grad  # numpy forward: no gradient
    case["plugin"].write_text(TORCH_PLUGIN + "\n# v2\n")
    custom_ops.load_plugins([case["plugin"]], "op_plugins")
    assert passes_gradient(node)
    out = node_runner(node, [])([x])[0]
    out.sum().backward()
    assert x.grad is not None and float(x.grad.abs().sum()) > 0


def test_the_registry_marks_a_plugin_op_cpu_only(case: dict[str, Path]) -> None:
    custom_ops.load_plugins([case["plugin"]], "op_plugins")
    d = opdefs.lookup("ClampScale", "my.ops")
    assert d is not None and "operator plugin" in d.cpu_only and not d.role and not d.lacks
    # onnx's shape inference sees through the op (from one run of its forward)
    inferred = onnx.shape_inference.infer_shapes(onnx.load(case["model"]), strict_mode=True)
    c = next(v for v in inferred.graph.value_info if v.name == "c")
    assert [d.dim_value for d in c.type.tensor_type.shape.dim] == [1, 4, 16]


def test_an_op_no_plugin_defines_is_named_with_the_fix(case: dict[str, Path]) -> None:
    model = make_model(case["root"] / "unknown.onnx", "Swish9", "other.ops")
    with pytest.raises(PulsarError, match=r"node 'clamp' uses op other.ops:Swish9.*register_op.*op_plugins"):
        pulsar.build(model, case["root"] / "out", config(case), quiet=True)
    assert not (case["root"] / "out").exists()


def test_a_plugin_that_fails_to_import_names_the_field_and_file(case: dict[str, Path]) -> None:
    case["plugin"].write_text("import numpy as np\nraise ValueError('bad plugin')\n")
    with pytest.raises(PulsarError, match=r"op_plugins: importing .*my_ops.py raised ValueError: bad plugin"):
        pulsar.build(case["model"], case["root"] / "out", config(case), quiet=True)


def test_a_forward_that_raises_names_plugin_op_and_node(case: dict[str, Path]) -> None:
    case["plugin"].write_text(PLUGIN.replace("CALLS.append(x.shape)", "raise RuntimeError('boom')"))
    with pytest.raises(PulsarError) as err:
        pulsar.build(case["model"], case["root"] / "out", config(case), quiet=True)
    text = str(err.value)
    assert "my_ops.py" in text and "my.ops:ClampScale" in text and "'clamp'" in text and "RuntimeError: boom" in text
    assert len(text.splitlines()) == 1


def test_a_plugin_may_not_take_a_standard_domain() -> None:
    with pytest.raises(PulsarError, match="domain of your own"):
        custom_ops.register_op("", "Relu", lambda x: x)
