"""quant.save_statistics / quant.statistics_file: the round trip reproduces the build bit for bit, a
hand-edited range changes exactly that tensor's grid, and a broken file is one error line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import pulsar
from pulsar.errors import PulsarError
from tests.hostile.harness import assert_clean_failure, run_cli


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny) -> tuple[pulsar.BuildResult, dict]:
    cfg = {"quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                                        "calibration_format": "Numpy", "calibration_size": 8}]}}
    root = tmp_path_factory.mktemp("stats")
    res = pulsar.build(tiny["model"], root / "a", cfg, {"quant.save_statistics": True, "work_dir": str(root / "w")},
                       quiet=True)
    return res, cfg


def _stats_path(res: pulsar.BuildResult) -> Path:
    return res.output_dir / "quant" / "statistics.json"


def _edited(src: Path, dst: Path, edit) -> Path:
    doc = json.loads(src.read_text())
    edit(doc)
    dst.write_text(json.dumps(doc))
    return dst


def test_the_file_is_documented_json(saved):
    res, _ = saved
    doc = json.loads(_stats_path(res).read_text())
    assert doc["format"] == "pulsar-calibration-statistics" and doc["version"] == 1
    r2 = doc["tensors"]["r2"]
    assert r2["count"] == sum(r2["histogram"]["counts"]) and r2["min"] <= r2["max"]
    assert r2["range_by"]["method"] == "MinMax" and r2["range"] == [0.0, r2["max"]]
    # the default cap (1 Mi values a sample), above every tensor of this model: each is binned whole
    assert doc["collection"] == {"bins": 4096, "momentum": 0.9, "binned_per_batch": 1 << 20}


def test_loading_the_file_reproduces_the_build_without_running_the_model(tmp_path, saved, tiny):
    res, cfg = saved
    again = pulsar.build(tiny["model"], tmp_path / "b", cfg, {"quant.statistics_file": str(_stats_path(res)),
                                                             "work_dir": str(tmp_path / "w")}, quiet=True)
    for f in ("quant/quantized.onnx", "quant/quant_config.json"):
        assert (res.output_dir / f).read_bytes() == (again.output_dir / f).read_bytes(), f
    log = (again.output_dir / "build.log").read_text()
    assert "loaded from" in log and "model not run" in log
    assert not list((tmp_path / "w").glob("cache/calib_stats_*"))  # no float pass, no cache written
    x = np.load(sorted(Path(tiny["calib"]).glob("*.npy"))[0])
    a = pulsar.Session(res.compiled_model).run({"image": x})["logits"]
    b = pulsar.Session(again.compiled_model).run({"image": x})["logits"]
    assert np.array_equal(a, b)


def test_an_edited_range_changes_exactly_that_tensors_grid(tmp_path, saved, tiny):
    res, cfg = saved

    def halve(doc):
        doc["tensors"]["r2"]["range"][1] /= 2

    path = _edited(_stats_path(res), tmp_path / "edited.json", halve)
    out = pulsar.build(tiny["model"], tmp_path / "e", cfg, {"quant.statistics_file": str(path)}, quiet=True)
    before = json.loads(res.quant_config.read_text())["tensors"]
    after = json.loads(out.quant_config.read_text())["tensors"]
    changed = {t for t in before if before[t]["scale"] != after[t]["scale"]}
    # r2 itself, and the bias of the layer reading it (a bias's step is input step x weight step)
    assert changed == {"r2", "c2.b"}, changed
    raw = json.loads(_stats_path(res).read_text())["tensors"]["r2"]["range"]  # the method's, before refinement
    assert after["r2"]["range"] == pytest.approx([raw[0], raw[1] / 2])
    assert after["r2"]["calibration"] == {"method": "statistics_file"}


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d["tensors"]["r2"].__setitem__("range", [0.0, float("nan")]), "NaN is not a number JSON allows"),
    (lambda d: d["tensors"]["r2"].__setitem__("range", [1.0, 0.5]), "tensor 'r2': range [1.0, 0.5] has lo > hi"),
    (lambda d: d["tensors"]["r2"].__setitem__("range", [0.5, 2.0]), "tensor 'r2': range [0.5, 2.0] must contain 0"),
    (lambda d: d["tensors"]["r2"].update(min=3.0, max=1.0), "tensor 'r2': min 3.0 > max 1.0"),
    (lambda d: d["tensors"].__setitem__("ghost", d["tensors"]["r2"]), "tensor 'ghost' is not in the optimized model"),
    (lambda d: d["tensors"].pop("r2"), "no statistics for 'r2'"),
    (lambda d: d.__setitem__("version", 7), "version 7, this pulsar reads version 1"),
    (lambda d: d["collection"].__setitem__("binned_per_batch", -1), '"binned_per_batch" is an integer >= 0'),
    (lambda d: d["collection"].__setitem__("binned_per_batch", None), '"binned_per_batch" is an integer >= 0'),
])
def test_a_broken_file_is_one_error_line(tmp_path, saved, tiny, edit, needle):
    res, cfg = saved
    path = _stats_path(res)
    doc = json.loads(path.read_text())
    edit(doc)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))  # json.dumps writes NaN literally: the file must refuse it
    with pytest.raises(PulsarError) as e:
        pulsar.build(tiny["model"], tmp_path / "x", cfg, {"quant.statistics_file": str(bad)}, quiet=True)
    assert needle in str(e.value) and str(bad) in str(e.value) and "\n" not in str(e.value)


def test_cli_error_names_the_file_and_writes_nothing(tmp_path, saved, tiny):
    res, cfg = saved
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    proc = run_cli(["build", "--input", str(tiny["model"]), "--config", "cfg.json", "--output_dir", "out",
                    "--quant.statistics_file", "missing.json"], tmp_path)
    assert_clean_failure(proc, ("quant.statistics_file 'missing.json'", "quant.save_statistics"))
    assert not (tmp_path / "out" / "compiled.pulsar").exists()


def test_a_histogram_cap_bins_a_weighted_sample(tmp_path, saved, tiny):
    """quant.calibration_histogram_values: past it each histogram holds an even sample of a calibration
    sample's values, each counted as many times as the stride: the extremes stay exact, the count is the
    values seen (within a stride a sample), and the statistics cache keeps the two builds apart."""
    res, cfg = saved
    exact = json.loads(_stats_path(res).read_text())
    got = pulsar.build(tiny["model"], tmp_path / "c", cfg, {"quant.save_statistics": True,
                                                            "quant.calibration_histogram_values": 256,
                                                            "work_dir": str(tmp_path / "w")}, quiet=True)
    doc = json.loads(_stats_path(got).read_text())
    assert doc["collection"]["binned_per_batch"] == 256
    for name in ("image", "r2"):
        e, s = exact["tensors"][name], doc["tensors"][name]
        assert (s["min"], s["max"], s["nonfinite"]) == (e["min"], e["max"], e["nonfinite"]), name
        assert s["count"] == sum(s["histogram"]["counts"]) and abs(s["count"] - e["count"]) <= 8 * 11, name
        assert s["histogram"]["counts"] != e["histogram"]["counts"], name
    assert json.loads((got.output_dir / "build_config.json").read_text())["quant"]["calibration_histogram_values"] == 256


def test_saving_the_statistics_does_not_change_the_build_identity():
    from pulsar.config import load_build_config

    plain = load_build_config({}, require_io=False)
    saving = load_build_config({"quant": {"save_statistics": True}}, require_io=False)
    loading = load_build_config({"quant": {"statistics_file": "s.json"}}, require_io=False)
    assert saving.hash == plain.hash  # an extra output only
    assert loading.hash != plain.hash  # hand-edited ranges may change the build
