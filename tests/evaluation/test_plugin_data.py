"""Evaluation data from a dataset plugin (``evaluation.input_configs[].calibration_dataset: file.py:fn``):
the figures equal those from the same arrays saved as .npy files; plugin mistakes are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import pulsar
from pulsar.errors import PulsarError


def _evaluation(dataset: str, fmt: str = "Numpy") -> dict:
    return {"metric": "cosine", "input_configs": [{"tensor_name": "DEFAULT", "calibration_dataset": dataset,
                                                  "calibration_format": fmt, "calibration_size": -1}]}


def _plugin(folder: Path, calib: Path, fail_at: int = -1) -> Path:
    path = folder / "eval_data.py"
    path.write_text(
        "from pathlib import Path\nimport numpy as np\n\n"
        "def samples():\n"
        f"    for i, f in enumerate(sorted(Path({str(calib)!r}).glob('*.npy'))):\n"
        f"        if i == {fail_at}:\n"
        "            raise RuntimeError('label file out of sync')\n"
        "        yield {'image': np.load(f)}\n")
    return path


def test_evaluation_from_a_plugin_equals_files(tiny, tiny_config, tmp_path) -> None:
    plugin = _plugin(tmp_path, tiny["calib"])
    pulsar.build(tiny["model"], tmp_path / "plugin", {**tiny_config, "evaluation": _evaluation(f"{plugin}:samples")},
                 quiet=True)
    pulsar.build(tiny["model"], tmp_path / "files", {**tiny_config, "evaluation": _evaluation(str(tiny["calib"]))},
                 quiet=True)
    got = json.loads((tmp_path / "plugin" / "evaluation.json").read_text())
    want = json.loads((tmp_path / "files" / "evaluation.json").read_text())
    assert got == want and got["samples"] == 8
    assert got["float"] == pytest.approx(1.0) and 0.5 < got["npu"] <= 1.0


def test_evaluation_plugin_error_before_anything_is_written(tiny, tiny_config, tmp_path) -> None:
    plugin = _plugin(tmp_path, tiny["calib"], fail_at=3)
    out = tmp_path / "out"
    with pytest.raises(PulsarError) as err:
        pulsar.build(tiny["model"], out, {**tiny_config, "evaluation": _evaluation(f"{plugin}:samples")}, quiet=True)
    assert str(err.value) == (f"evaluation.input_configs[0].calibration_dataset: plugin {plugin}:samples: sample 3: "
                              "the plugin raised RuntimeError: label file out of sync; fix the plugin")
    assert not out.exists()
