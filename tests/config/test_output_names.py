"""``output_name`` never collides with another artifact: every name a build or a sweep puts at the top
of an output directory is refused (one error line, naming the artifact), and real builds with many
options and a sweep write nothing at the top outside that list and the compiled model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import pulsar
from pulsar.config import ConfigError, load_build_config
from pulsar.config.artifacts import OUTPUT_DIR_ENTRIES, RESERVED_PREFIXES, colliding_artifact
from pulsar.errors import PulsarError
from tests.hostile.harness import assert_clean_failure, run_cli
from tests.tiny_model import make_numpy_calibration


@pytest.mark.parametrize("name", sorted(OUTPUT_DIR_ENTRIES))
def test_every_artifact_name_is_refused(name):
    for given in (name, name.upper()):  # a case-insensitive file system makes them the same file
        with pytest.raises(ConfigError) as e:
            load_build_config({"output_name": given}, require_io=False)
        assert e.value.problems == [f"output_name: {given!r} is the name of another artifact of the build "
                                    f"({name}, {OUTPUT_DIR_ENTRIES[name]}): the compiled model and it would "
                                    "overwrite each other; choose another name, e.g. 'compiled.pulsar'"]


def test_prefixes_and_ordinary_names():
    for prefix in RESERVED_PREFIXES:
        assert colliding_artifact(prefix + "-staging-12") is not None
    for fine in ("model.pulsar", "evaluation.json.pulsar", "quant.pulsar", "build_config.json5"):
        assert colliding_artifact(fine) is None
        load_build_config({"output_name": fine}, require_io=False)


@pytest.fixture(scope="module")
def evalset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_numpy_calibration(tmp_path_factory.mktemp("evalset") / "data", n=4, seed=3)


def _config(tiny: dict[str, Path], evalset: Path, **quant: object) -> dict[str, object]:
    entry = {"tensor_name": "image", "calibration_format": "Numpy"}
    return {"quant": {"input_configs": [{**entry, "calibration_dataset": str(tiny["calib"]), "calibration_size": 8}],
                      **quant},
            "evaluation": {"metric": "cosine", "input_configs": [{**entry, "calibration_dataset": str(evalset),
                                                                  "calibration_size": -1}]}}


def _top(out: Path) -> set[str]:
    return {p.name for p in out.iterdir()}


def test_a_build_with_many_options_writes_only_listed_names(tmp_path, tiny, evalset):
    cfg = _config(tiny, evalset, precision_analysis=True, auto_mixed_precision={"enable": True,
                                                                               "max_16bit_layers": 1})
    out = tmp_path / "out"
    pulsar.build(tiny["model"], out, cfg, {"output_name": "m.bin", "compiler.check": 1, "compiler.npu_perf": True,
                                           "compiler.static_batch_sizes": [1, 2], "onnx_opt.model_check": True},
                 quiet=True)
    assert (out / "m.bin").is_file() and (out / "evaluation.json").is_file()
    assert _top(out) - {"m.bin"} <= set(OUTPUT_DIR_ENTRIES), _top(out)
    # built again into the same directory, with a build that fails: still nothing else
    with pytest.raises(PulsarError):
        pulsar.build(tiny["model"], out, {**cfg, "quant": {**cfg["quant"], "input_configs": [
            {"tensor_name": "image", "calibration_dataset": str(tmp_path / "none"), "calibration_format": "Numpy"}]}},
                     quiet=True)
    assert _top(out) - {"m.bin"} <= set(OUTPUT_DIR_ENTRIES), _top(out)


def test_a_sweep_writes_only_listed_names(tmp_path, tiny, evalset):
    base = tmp_path / "base.json"
    base.write_text(json.dumps(_config(tiny, evalset)))
    space = tmp_path / "space.yaml"
    space.write_text("quant.calibration_method: [MinMax]\n")
    out = tmp_path / "sweep"
    rows = pulsar.sweep(tiny["model"], base, space, out, workers=1, quiet=True)
    assert rows[0]["status"] == "ok", rows
    assert _top(out) <= set(OUTPUT_DIR_ENTRIES), _top(out)
    trial = out / "trials" / "0"
    assert _top(trial) - {"compiled.pulsar"} <= set(OUTPUT_DIR_ENTRIES), _top(trial)


def test_evaluation_json_as_output_name_is_refused_before_anything_is_written(tmp_path, tiny, evalset):
    """The data-loss case: the evaluation report used to overwrite the compiled model, exit 0."""
    (tmp_path / "c.json").write_text(json.dumps({**_config(tiny, evalset), "output_name": "evaluation.json"}))
    proc = run_cli(["build", "--input", str(tiny["model"]), "--output_dir", "out", "--config", "c.json"], tmp_path)
    assert_clean_failure(proc, ("output_name: 'evaluation.json'", "evaluation report"))
    assert not (tmp_path / "out").exists()
