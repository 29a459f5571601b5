"""compiler.check 1 and 3 at their default settings (check_mode CheckPerLayer, check_rtol 1e-5,
check_atol 0, check_cosine_simularity 0.999) pass on a correct compiled model and stop on one the
compiler got wrong: a corrupted requant multiplier, a wrong lookup table, swapped zero points. Each
corruption is made in the loaded compiled model the way a compiler bug would make it, and the
failure is one line naming the tensor, the measured value and the threshold."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import pulsar
from pulsar.config import load_build_config
from pulsar.core.container import CompiledModel, Subgraph, load_compiled
from pulsar.core.tensor_io import random_inputs
from pulsar.errors import PulsarError
from pulsar.runtime.check import CHECKS, CODES, Grid, compare, verdict
from pulsar.runtime.session import Session
from tests.tiny_model import make_numpy_calibration

ROOT = Path(__file__).resolve().parents[2]


def _make_silu_cnn(path: Path) -> Path:
    """Conv -> SiLU (Sigmoid, a lookup table on the NPU, times its input) -> 1x1 Conv + residual -> GAP -> Gemm."""
    rng = np.random.default_rng(0)

    def init(name: str, *shape: int, scale: float = 0.3) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    inits = [init("c1.w", 8, 3, 3, 3), init("c1.b", 8, scale=0.1), init("c2.w", 8, 8, 1, 1),
             init("c2.b", 8, scale=0.1), init("fc.w", 10, 8), init("fc.b", 10, scale=0.1)]
    nodes = [
        helper.make_node("Conv", ["image", "c1.w", "c1.b"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Sigmoid", ["c1"], ["sig"], name="sigmoid"),
        helper.make_node("Mul", ["c1", "sig"], ["silu"], name="silu"),
        helper.make_node("Conv", ["silu", "c2.w", "c2.b"], ["c2"], name="conv2"),
        helper.make_node("Add", ["c2", "silu"], ["res"], name="residual"),
        helper.make_node("GlobalAveragePool", ["res"], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "fc.w", "fc.b"], ["logits"], name="fc", transB=1),
    ]
    graph = helper.make_graph(nodes, "silu_cnn", [helper.make_tensor_value_info("image", TensorProto.FLOAT,
                                                                                [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def _config(calib: Path) -> dict[str, Any]:
    return {"quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(calib),
                                         "calibration_format": "Numpy", "calibration_size": 8}]}}


def _defaults(config: dict[str, Any], check: int) -> Any:
    """The compiler section as a build with ``compiler.check`` ``check`` and nothing else set sees it."""
    c = load_build_config(config, {"compiler.check": check}, require_io=False).cfg.compiler
    assert (c.check_mode, c.check_rtol, c.check_atol, c.check_cosine_simularity) == ("CheckPerLayer", 1e-5, 0, 0.999)
    return SimpleNamespace(**vars(c))  # a copy a test may change


@pytest.fixture(scope="module")
def silu(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("silu")
    model, calib = _make_silu_cnn(root / "silu.onnx"), make_numpy_calibration(root / "calib")
    config = _config(calib)
    # the build itself runs the default check 3 (a failure would raise here)
    res = pulsar.build(model, root / "out", config, {"compiler.check": 3}, quiet=True)
    samples = [{"image": np.load(f)} for f in sorted(calib.glob("*.npy"))[:2]]
    sess = Session(res.compiled_model)
    samples += [random_inputs(sess.inputs, seed=i) for i in range(2)]
    return {"model": model, "config": config, "compiled": res.compiled_model, "samples": samples, "root": root}


def _npu(compiled: CompiledModel) -> Subgraph:
    return next(sg for sg in compiled.subgraphs if sg.kind == "npu")


def _node(sg: Subgraph, op_type: str, output: str) -> onnx.NodeProto:
    return next(n for n in sg.graph.node if n.op_type == op_type and n.output[0] == output)


def _edit_init(sg: Subgraph, name: str, change: Callable[[np.ndarray], np.ndarray]) -> None:
    init = next(t for t in sg.graph.initializer if t.name == name)
    old = numpy_helper.to_array(init)
    new = change(old.copy()).astype(old.dtype)
    assert not np.array_equal(new, old)
    init.CopyFrom(numpy_helper.from_array(new, name))


def _swap_attrs(node: onnx.NodeProto, a: str, b: str) -> None:
    attrs = {x.name: x for x in node.attribute}
    assert attrs[a].i != attrs[b].i, "swapping equal zero points changes nothing"
    attrs[a].i, attrs[b].i = attrs[b].i, attrs[a].i


def _check(path: Path, samples: list[dict[str, np.ndarray]], c: Any,
           corrupt: Callable[[CompiledModel], None] | None = None) -> None:
    """compiler.check ``c`` of the compiled model at ``path`` (after ``corrupt`` edits the loaded program)
    against its own float QDQ reference, as the build runs it."""
    compiled = load_compiled(path)
    if corrupt is not None:
        corrupt(compiled)
    compare(Session(compiled), Session(load_compiled(path), mode="Reference"), samples, c, "float QDQ reference")


# ------------------------------------------------------------------------------------------ good models


@pytest.mark.parametrize("check", [1, 3])
def test_default_check_passes_in_the_build(silu, tmp_path, check):
    pulsar.build(silu["model"], tmp_path / "out", silu["config"], {"compiler.check": check}, quiet=True)
    log = (tmp_path / "out" / "build.log").read_text()
    assert re.search(rf"compiler check {check} passed: \d+ tensor comparisons over 2 samples", log)
    assert f"Compiler check {check} ({CHECKS[check]}, CheckPerLayer) vs float QDQ reference: pass" in log


@pytest.mark.parametrize("check", [1, 3])
def test_default_check_passes_on_calibration_and_random_samples(silu, check):
    _check(silu["compiled"], silu["samples"], _defaults(silu["config"], check))


def test_the_lookup_table_is_on_the_npu(silu):
    ops = {n.op_type for n in _npu(load_compiled(silu["compiled"])).graph.node}
    assert {"QConv", "QLut", "QMul", "QAdd"} <= ops


# ------------------------------------------------------------------------------------------ corruptions


def _multiplier(compiled: CompiledModel) -> None:
    """One channel's requant multiplier of conv2 halved (a wrong per-channel scale)."""
    sg = _npu(compiled)
    m = _node(sg, "QConv", "c2/q").input[3]

    def halve(a: np.ndarray) -> np.ndarray:
        a.flat[0] //= 2
        return a

    _edit_init(sg, m, halve)


def _lut(compiled: CompiledModel) -> None:
    """The Sigmoid table read 16 input codes off (a table built for another input zero point)."""
    sg = _npu(compiled)
    _edit_init(sg, _node(sg, "QLut", "sig/q").input[1], lambda t: np.roll(t, 16))


def _zero_point(compiled: CompiledModel) -> None:
    """The SiLU multiply with its two input zero points swapped."""
    _swap_attrs(_node(_npu(compiled), "QMul", "silu/q"), "a_zp", "b_zp")


CORRUPTIONS = {"requant_multiplier": (_multiplier, "c2/q"), "lookup_table": (_lut, "sig/q"),
               "swapped_zero_point": (_zero_point, "silu/q")}


@pytest.mark.parametrize("check", [1, 3])
@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_default_check_catches_a_corrupted_program(silu, corruption, check):
    corrupt, tensor = CORRUPTIONS[corruption]
    c = _defaults(silu["config"], check)
    with pytest.raises(PulsarError) as e:
        _check(silu["compiled"], silu["samples"], c, corrupt)
    message = str(e.value)
    assert "\n" not in message  # the CLI prints it as one "error:" line
    assert message.startswith(f"compiler.check {check} (") and "CheckPerLayer) failed on tensor" in message
    assert f"'{tensor}'" in message, message  # the corrupted op's own output: each op is fed the reference inputs
    if check == 1:
        assert re.search(r"code \d+ vs \d+, \d+ steps apart > allowed 1(\.\d+)?\b", message), message
        assert "check_atol 0 + check_rtol 1e-05" in message
    else:
        value = float(re.search(r"cosine (-?[0-9.]+) of the dequantized values < check_cosine_simularity 0.999",
                                message).group(1))  # type: ignore[union-attr]
        assert value < 0.999


def test_black_listed_tensor_is_skipped_and_the_next_one_is_clean(silu):
    c = _defaults(silu["config"], 1)
    c.check_tensor_black_list = [r"^c2/q$"]
    _check(silu["compiled"], silu["samples"], c, _multiplier)  # per layer, the error does not propagate


def test_explicit_check_output_still_compares_outputs_end_to_end(silu):
    c = _defaults(silu["config"], 3)
    c.check_mode = "CheckOutput"
    _check(silu["compiled"], silu["samples"], c)
    with pytest.raises(PulsarError, match=r"failed on output 'logits' of sample \d+ .*: cosine [0-9.]+ < "
                                          r"check_cosine_simularity 0\.999$"):
        _check(silu["compiled"], silu["samples"], c, _zero_point)
    c = _defaults(silu["config"], 1)
    c.check_mode = "CheckOutput"  # float outputs, end to end: numpy.allclose with check_rtol / check_atol
    with pytest.raises(PulsarError, match=r"failed on output 'logits' .* > allowed"):
        _check(silu["compiled"], silu["samples"], c, _multiplier)


# ------------------------------------------------------------------------------------------ the comparison


def _c(**kw: Any) -> Any:
    return SimpleNamespace(**{"check_rtol": 1e-5, "check_atol": 0.0, "check_cosine_simularity": 0.999, **kw})


def test_integer_tensors_are_compared_on_their_grid():
    grid = Grid(np.array([0.05]), np.array([128.0]))
    rng = np.random.default_rng(0)
    want = rng.integers(60, 200, (1, 8, 6, 6)).astype(np.uint8)
    one = want.copy()
    one.flat[::7] += 1  # rounding: one step on some elements
    two = want.copy()
    two.flat[5] += 2
    grids = {"t": grid}
    assert verdict(1, one, want, grids, "t", _c()) is None
    assert verdict(3, one, want, grids, "t", _c()) is None
    why = verdict(1, two, want, grids, "t", _c())
    assert why is not None and "1 of 288 elements" in why and "2 steps apart > allowed 1" in why \
        and "scale 0.05, zero point 128" in why
    # check_atol is in real units: 0.1 = two steps of 0.05
    assert verdict(1, two, want, grids, "t", _c(check_atol=0.1)) is None


def test_cosine_is_taken_on_dequantized_values():
    grid = Grid(np.array([0.1]), np.array([128.0]))
    rng = np.random.default_rng(1)
    noise = rng.integers(-3, 4, 1000)
    want, got = (128 + noise).astype(np.uint8), (128 - noise).astype(np.uint8)  # the sign of every value flipped
    raw = float(np.dot(got.astype(float), want) / np.linalg.norm(got.astype(float)) / np.linalg.norm(want.astype(float)))
    assert raw > 0.999  # raw codes around zero point 128 look alike
    why = verdict(3, got, want, {"t": grid}, "t", _c())
    assert why is not None and "cosine -1.000000 of the dequantized values < check_cosine_simularity 0.999" in why


def test_one_step_rounding_on_a_small_tensor_passes_check_3():
    # all zero in the reference, one element rounded up: cosine 0, yet a rounding difference only
    want = np.full((1, 4, 1, 1), 10, np.uint8)
    got = want.copy()
    got.flat[2] = 11
    grid = Grid(np.array([0.02]), np.array([10.0]))
    assert verdict(3, got, want, {"t": grid}, "t", _c()) is None
    got.flat[2] = 12
    assert verdict(3, got, want, {"t": grid}, "t", _c()) is not None


def test_integer_tensor_without_a_known_grid_is_compared_in_codes():
    want = np.arange(-50, 50, dtype=np.int16)
    assert verdict(1, want + 1, want, {}, "t", _c()) is None
    assert verdict(1, want + 2, want, {}, "t", _c()) is not None
    assert CODES.describe() == "scale 1, zero point 0"


def test_float_tensors_keep_numpy_allclose():
    want = np.linspace(-1, 1, 11, dtype=np.float32)
    assert verdict(1, want * (1 + 5e-6), want, {}, "t", _c()) is None
    why = verdict(1, want * 1.01, want, {}, "t", _c())
    assert why is not None and "outside check_atol 0 + check_rtol 1e-05 x |reference|" in why


# ------------------------------------------------------------------------------------------ real model


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The example models and calibration sets, made from the installed packages (as CI has no
    examples/assets)."""
    from examples.assets import make_example_assets

    return make_example_assets(tmp_path_factory.mktemp("assets"), n_calib=8)


def _real(assets: dict[str, Path], model: str, tmp_path: Path, check: int) -> Path:
    cfg = json.loads(re.sub(r"^\s*#.*$", "", (ROOT / "configs" / f"{model}.json").read_text(), flags=re.M))
    cfg["compiler"].pop("check_mode", None)  # the default
    entry = cfg["quant"]["input_configs"][0]
    key = {"imagenet_calib.tar": "imagenet_calib_tar", "ocr_calib": "ocr_calib"}[Path(entry["calibration_dataset"]).name]
    entry["calibration_dataset"] = str(assets[key])
    entry["calibration_size"] = 8
    return pulsar.build(assets[model], tmp_path / "out", cfg, {"compiler.check": check}, quiet=True).compiled_model


@pytest.mark.slow
@pytest.mark.parametrize("check", [1, 3])
@pytest.mark.parametrize("model", ["mobilenetv2", "ocr_rec"])
def test_real_model_passes_the_default_check(assets, tmp_path, model, check):
    _real(assets, model, tmp_path, check)  # the build runs the check and raises if it fails
    log = (tmp_path / "out" / "build.log").read_text()
    assert f"Compiler check {check} ({CHECKS[check]}, CheckPerLayer) vs float QDQ reference: pass" in log


@pytest.mark.slow
def test_mobilenetv2_default_checks_catch_swapped_zero_points(assets, tmp_path):
    compiled = _real(assets, "mobilenetv2", tmp_path, 0)
    sg = _npu(load_compiled(compiled))

    def gap(n: onnx.NodeProto) -> int:
        attrs = {a.name: a.i for a in n.attribute}
        return abs(attrs["x_zp"] - attrs["out_zp"])

    conv = max((n for n in sg.graph.node if n.op_type == "QConv"), key=gap)  # zero points furthest apart

    def swap(m: CompiledModel) -> None:
        _swap_attrs(next(n for n in _npu(m).graph.node if n.name == conv.name), "x_zp", "out_zp")

    samples = [random_inputs(Session(compiled).inputs, seed=0)]
    for check in (1, 3):
        c = _defaults({}, check)
        _check(compiled, samples, c)
        with pytest.raises(PulsarError, match=re.escape(f"failed on tensor '{conv.output[0]}'")):
            _check(compiled, samples, c, swap)
