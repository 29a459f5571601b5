"""compiler.sub_configs options act per range: the pulsar2 guide's example (``check: 2`` on one range,
check 0 at the top level) checks that range only; a range's own check level, check_mode, tolerances
and black list apply to its tensors, the top level's to every other one; ddr_bw_limit acts on the
range's subgraphs in the estimate; whole-model options are reset with a warning; build_config.json
holds each range's effective options."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from numpy.typing import NDArray
from onnx import numpy_helper

import pulsar
from pulsar.compiler.cost import estimate_model
from pulsar.compiler.stage import sub_ranges
from pulsar.config import load_build_config
from pulsar.core.container import CompiledModel, Subgraph, load_compiled
from pulsar.core.tensor_io import random_inputs
from pulsar.errors import PulsarError
from pulsar.runtime.check import compare_scopes, integer_reference
from pulsar.runtime.check_scopes import scopes_of
from pulsar.runtime.session import Session

RANGE = {"start_tensor_names": ["r1"], "end_tensor_names": ["r2"]}  # dwconv + relu2 of the tiny CNN: r2/q
LABEL = "compiler.sub_configs[0] (r1 -> r2)"


def _quant(tiny: dict[str, Path]) -> dict[str, Any]:
    return {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                               "calibration_format": "Numpy", "calibration_size": 8}]}


@pytest.fixture(scope="module")
def guide(tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """The guide's example on the tiny CNN: check 0 at the top level, check 2 on one range."""
    out = tmp_path_factory.mktemp("guide") / "out"
    compiler = {"check": 0, "sub_configs": [{**RANGE, "check": 2}]}
    return pulsar.build(tiny["model"], out, {"quant": _quant(tiny), "compiler": compiler}, quiet=True), out


def test_guide_example_checks_that_range_only(guide):
    res, out = guide
    log = (out / "build.log").read_text()
    assert f"compiler check 2 passed on {LABEL}: 2 tensor comparisons over 2 samples" in log
    assert "compiler check: compiler (the tensors outside the sub_configs ranges) not checked (check 0)" in log
    assert "NPU subgraph npu_1_sub0, 1 ops, lut_items_in_bits 10, check 2" in log
    top, ranged = json.loads((out / "compiler" / "check_result.json").read_text())["scopes"]
    assert top["check"] == 0 and top["result"] == "not checked (check 0)" and top["tensors"] == []
    assert (ranged["range"], ranged["check"], ranged["result"]) == (LABEL, 2, "pass")
    assert ranged["tensors"] == ["r2/q"] and ranged["comparisons"] == 2  # the range's QConv, 2 samples
    assert [o["difference"].split(",")[0] for o in ranged["outputs"]] == ["max abs diff 0"] * 2


def test_guide_example_build_config_holds_the_effective_range_options(guide):
    _, out = guide
    data = json.loads((out / "build_config.json").read_text())
    (entry,) = data["compiler"]["sub_configs"]
    assert data["compiler"]["check"] == 0 and entry["check"] == 2  # its own
    for key in ("check_mode", "check_rtol", "check_atol", "lut_items_in_bits", "static_batch_sizes"):
        assert entry[key] == data["compiler"][key], key  # inherited, written out
    assert "input_sample_dir" not in entry and "npu_perf" not in entry  # whole-model options: top level only
    # the file builds the same: loading it again changes nothing
    assert load_build_config(data, require_io=False).data["compiler"] == data["compiler"]


# ---------------------------------------------------------------------------- damage inside / outside


def _npu_with(compiled: CompiledModel, output: str) -> tuple[Subgraph, onnx.NodeProto]:
    for sg in compiled.subgraphs:
        for n in sg.graph.node:
            if sg.kind == "npu" and n.op_type == "QConv" and n.output[0] == output:
                return sg, n
    raise AssertionError(output)


def _halve_multiplier(output: str) -> Callable[[CompiledModel], None]:
    """One channel's requant multiplier of the QConv making ``output`` halved (a compiler bug)."""
    def corrupt(compiled: CompiledModel) -> None:
        sg, node = _npu_with(compiled, output)
        init = next(t for t in sg.graph.initializer if t.name == node.input[3])
        a: NDArray[Any] = numpy_helper.to_array(init).copy()
        a.flat[0] //= 2
        init.CopyFrom(numpy_helper.from_array(a, init.name))
    return corrupt


INSIDE, OUTSIDE = "r2/q", "r1/q"  # the range's conv; conv1 (+ folded BN + relu1) before it


def _run_check(res: Any, out: Path, top: dict[str, Any], sub: dict[str, Any],
               corrupt: Callable[[CompiledModel], None] | None = None) -> None:
    """compiler.check of the built model (after ``corrupt``), the top level's options ``top``, the
    range's own ``sub``, as the build runs it."""
    compiled = load_compiled(res.compiled_model)
    if corrupt is not None:
        corrupt(compiled)
    cfg = load_build_config({"compiler": {**top, "sub_configs": [{**RANGE, **sub}]}}, require_io=False).cfg
    subs = sub_ranges(cfg.compiler)  # as the compiler stage makes them
    scopes = scopes_of(cfg.compiler, subs)
    sim = Session(compiled)
    refs: dict[str, tuple[Session, str]] = {"float": (Session(load_compiled(res.compiled_model), mode="Reference"),
                                                      "float QDQ reference")}
    if any(s.c.check == 2 for s in scopes):
        qdq = onnx.load(str(res.quantized_model))
        refs["integer"] = (integer_reference(qdq, out / "check_ref.pulsar", sub_configs=subs), "integer reference")
    samples = [random_inputs(sim.inputs, seed=i) for i in range(2)]
    compare_scopes(sim, refs, samples, [s for s in scopes if s.c.check])


def test_guide_example_catches_damage_inside_the_range_only(guide, tmp_path):
    res, _ = guide
    with pytest.raises(PulsarError) as e:
        _run_check(res, tmp_path, {"check": 0}, {"check": 2}, _halve_multiplier(INSIDE))
    message = str(e.value)
    assert message.startswith("compiler.check 2 (all-equal, CheckPerLayer) failed on tensor 'r2/q' of sample 0 "
                              f"in {LABEL} against the integer reference: "), message
    _run_check(res, tmp_path, {"check": 0}, {"check": 2}, _halve_multiplier(OUTSIDE))  # not checked: passes
    # the same damage outside is caught once the top level checks too, and named as outside the ranges
    with pytest.raises(PulsarError, match=r"failed on tensor 'r1/q' of sample 0 in compiler \(the tensors outside"):
        _run_check(res, tmp_path, {"check": 2}, {"check": 0}, _halve_multiplier(OUTSIDE))
    _run_check(res, tmp_path, {"check": 2}, {"check": 0}, _halve_multiplier(INSIDE))  # range off: passes


def test_range_tolerances_are_its_own(guide, tmp_path):
    res, _ = guide
    damage = _halve_multiplier(INSIDE)
    with pytest.raises(PulsarError, match=r"check 1 \(all-close, CheckPerLayer\) failed on tensor 'r2/q' .* "
                                          r"check_atol 0 \+ check_rtol 1e-05"):
        _run_check(res, tmp_path, {"check": 1}, {}, damage)  # inherited top-level tolerances
    _run_check(res, tmp_path, {"check": 1}, {"check_atol": 100.0}, damage)  # the range's own tolerance
    _run_check(res, tmp_path, {"check": 1}, {"check": 3, "check_cosine_simularity": -1.0}, damage)
    _run_check(res, tmp_path, {"check": 1}, {"check_tensor_black_list": ["^r2/q$"]}, damage)
    with pytest.raises(PulsarError, match="failed on tensor 'r1/q'"):  # the top level keeps its own tolerance
        _run_check(res, tmp_path, {"check": 1}, {"check_atol": 100.0}, _halve_multiplier(OUTSIDE))


def test_range_check_output_compares_its_outputs_fed_the_reference(guide, tmp_path):
    res, _ = guide
    sub = {"check": 1, "check_mode": "CheckOutput"}
    _run_check(res, tmp_path, {"check": 0}, sub)
    with pytest.raises(PulsarError, match=rf"check 1 \(all-close, CheckOutput\) failed on output 'r2/q' of sample 0 "
                                          rf"in {re.escape(LABEL)} against"):
        _run_check(res, tmp_path, {"check": 0}, sub, _halve_multiplier(INSIDE))
    # fed the reference's inputs: damage upstream of the range does not reach its outputs
    _run_check(res, tmp_path, {"check": 0}, sub, _halve_multiplier(OUTSIDE))


# ---------------------------------------------------------------------------- config and other options


def _load(compiler: dict[str, Any]) -> Any:
    return load_build_config({"compiler": compiler}, require_io=False)


def test_check_options_follow_each_range_check():
    eff = _load({"check": 0, "check_rtol": 0.1, "check_mode": "CheckOutput",
                 "sub_configs": [{**RANGE, "check": 2, "check_atol": 0.5},
                                 {"start_tensor_names": ["a"], "end_tensor_names": ["b"], "check": 1}]})
    c = eff.data["compiler"]
    # check 0 at the top, but the ranges inherit check_rtol / check_mode: kept
    assert (c["check_rtol"], c["check_mode"]) == (0.1, "CheckOutput")
    first, second = c["sub_configs"]
    assert first["check_atol"] == 0 and second["check_rtol"] == 0.1  # check 2 range: its check_atol removed
    assert eff.warnings == ("compiler.sub_configs[0].check_atol is set (0.5) but has no effect without this range's "
                            "check 1 (all-close); ignored (removed: the range inherits the compiler section's value)",)
    # nothing inherits them: the top-level reset as before
    assert _load({"check": 0, "check_rtol": 0.1, "sub_configs": [{**RANGE, "check": 1, "check_rtol": 0.2}]}
                 ).data["compiler"]["check_rtol"] == 1e-5


def test_whole_model_options_in_a_range_warn_and_are_dropped():
    eff = _load({"check": 1, "sub_configs": [{**RANGE, "npu_perf": True, "input_sample_dir": "elsewhere"}]})
    (entry,) = eff.data["compiler"]["sub_configs"]
    assert "npu_perf" not in entry and "input_sample_dir" not in entry
    assert [w.split(" is set")[0] for w in eff.warnings] == ["compiler.sub_configs[0].input_sample_dir",
                                                            "compiler.sub_configs[0].npu_perf"]
    assert all("set compiler." in w for w in eff.warnings)
    with pytest.raises(pulsar.config.ConfigError, match="disable_ir_fix"):
        _load({"sub_configs": [{**RANGE, "disable_ir_fix": True}]})


def test_range_check_options_leave_the_config_hash_alone():
    plain = _load({"sub_configs": [RANGE]})
    checked = _load({"sub_configs": [{**RANGE, "check": 2, "check_mode": "CheckOutput"}]})
    assert plain.hash == checked.hash
    assert _load({"sub_configs": [{**RANGE, "lut_items_in_bits": 8}]}).hash != plain.hash


def test_ddr_bw_limit_acts_on_the_range_subgraphs(guide):
    res, _ = guide
    sgs = load_compiled(res.compiled_model).subgraphs
    for sg in sgs:
        if "sub_config" in sg.options:
            sg.options = {**sg.options, "ddr_bw_limit": 0.5}
    target = load_build_config(json.loads((res.output_dir / "build_config.json").read_text()),
                               require_io=False).cfg.target_hardware
    est = estimate_model(sgs, target, "NPU1", 0.0)
    bw = {e.name: e.ddr_bandwidth_gbps for e in est.subgraphs}
    assert bw.pop("npu_1_sub0") == 0.5
    assert bw and all(v > 0.5 for v in bw.values())
    assert np.isclose(est.ddr_bandwidth_gbps, max(bw.values()))
