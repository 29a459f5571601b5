"""``evaluation``: the build scores the float, QDQ and compiled models; the figures match an
independent evaluation; every bad metric or evaluation setting is one error line, exit 2."""

from __future__ import annotations

import json
import os

import numpy as np
import onnxruntime as ort
import pytest

import pulsar
from pulsar.core.ort_options import reference_session_options
from pulsar.errors import PulsarError
from pulsar.runtime.session import Session
from tests.cli_fork import run_pulsar
from tests.tiny_model import make_numpy_calibration

# many real builds in subprocesses: outside the fast tier (pytest -m "not slow"); CI runs them
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def evalset(tiny, tmp_path_factory) -> dict:
    """40 samples and labels: the float model's top-1 with every third label moved (float top-1 2/3)."""
    root = tmp_path_factory.mktemp("evalset")
    data = make_numpy_calibration(root / "data", n=40, seed=7)
    sess = ort.InferenceSession(str(tiny["model"]), providers=["CPUExecutionProvider"])
    files = sorted(data.glob("*.npy"))
    labels = np.array([int(np.argmax(sess.run(None, {"image": np.load(f)})[0])) for f in files])
    labels[::3] = (labels[::3] + 1) % 10
    np.save(root / "labels.npy", labels)
    return {"data": data, "labels": root / "labels.npy", "files": files, "y": labels}


def _config(tiny_config: dict, evalset: dict, metric: str, **extra) -> dict:
    ev = {"metric": metric, "input_configs": [{"tensor_name": "image", "calibration_dataset": str(evalset["data"]),
                                               "calibration_format": "Numpy", "calibration_size": -1}], **extra}
    return {**tiny_config, "evaluation": ev}


def test_top1_matches_an_independent_evaluation(tiny, tiny_config, evalset, tmp_path) -> None:
    cfg = _config(tiny_config, evalset, "top1", labels=str(evalset["labels"]))
    built = pulsar.build(tiny["model"], tmp_path / "out", cfg, quiet=True)
    got = json.loads((tmp_path / "out" / "evaluation.json").read_text())
    assert got["metric"] == "top1" and got["samples"] == 40
    # independent: each model run by hand on every file, top-1 counted against the labels
    fl = ort.InferenceSession(str(tiny["model"]), providers=["CPUExecutionProvider"])
    qdq = ort.InferenceSession(str(built.quantized_model), reference_session_options(),
                               providers=["CPUExecutionProvider"])
    npu = Session(built.compiled_model, mode="NPUBackend")
    want = {"float": [], "qdq": [], "npu": []}
    for f, y in zip(evalset["files"], evalset["y"], strict=True):
        x = {"image": np.load(f)}
        want["float"].append(np.argmax(fl.run(None, x)[0]) == y)
        want["qdq"].append(np.argmax(qdq.run(None, x)[0]) == y)
        want["npu"].append(np.argmax(npu.run(x)["logits"]) == y)
    for k, v in want.items():
        assert got[k] == pytest.approx(float(np.mean(v)), abs=1e-12), k
    assert abs(got["float"] - 2 / 3) < 0.05  # the moved labels are wrong for the float model too
    assert "evaluation top1: npu" in (tmp_path / "out" / "build.log").read_text()


def test_agreement_and_cosine_compare_with_float(tiny, tiny_config, evalset, tmp_path) -> None:
    for metric in ("top1_agreement", "cosine"):
        pulsar.build(tiny["model"], tmp_path / metric, _config(tiny_config, evalset, metric), quiet=True)
        got = json.loads((tmp_path / metric / "evaluation.json").read_text())
        assert got["float"] == pytest.approx(1.0)
        assert 0.5 < got["npu"] <= 1.0 and 0.5 < got["qdq"] <= 1.0


def test_a_plugin_metric_gets_each_model_as_a_session(tiny, tiny_config, tmp_path) -> None:
    plugin = tmp_path / "my_metric.py"
    plugin.write_text(
        "import numpy as np\n"
        "def mean_logit(session):\n"
        "    x = np.full(session.inputs[0].shape, 0.5, np.float32)\n"
        "    return float(session.run({session.inputs[0].name: x})['logits'].mean())\n")
    pulsar.build(tiny["model"], tmp_path / "out", {**tiny_config, "evaluation": {"metric": f"{plugin}:mean_logit"}},
                 quiet=True)
    got = json.loads((tmp_path / "out" / "evaluation.json").read_text())
    fl = ort.InferenceSession(str(tiny["model"]), providers=["CPUExecutionProvider"])
    want = float(fl.run(None, {"image": np.full((1, 3, 16, 16), 0.5, np.float32)})[0].mean())
    assert got["float"] == pytest.approx(want, rel=1e-6)
    assert got["npu"] == pytest.approx(got["qdq"], abs=0.05)  # both quantized: the simulator tracks the QDQ model


def test_a_plugin_gets_all_three_models_in_the_deployed_format(tiny, tiny_config, tmp_path) -> None:
    """With input_processors (uint8 RGB NHWC pixels in), the float and QDQ models run behind the same
    processors the compiled model starts with: the plugin feeds one format to all three, and the float
    figure is the float model's on those pixels converted by hand."""
    plugin = tmp_path / "pixels.py"
    plugin.write_text(
        "import numpy as np\n"
        "def mean_logit(session):\n"
        "    (info,) = session.inputs\n"
        "    assert (info.name, tuple(info.shape), np.dtype(info.dtype)) == ('image', (1, 16, 16, 3), np.uint8), info\n"
        "    x = np.random.default_rng(0).integers(0, 256, (1, 16, 16, 3), dtype=np.uint8)\n"
        "    return float(session.run({'image': x})['logits'].mean())\n")
    procs = [{"tensor_name": "image", "src_layout": "NHWC", "src_dtype": "U8", "tensor_format": "RGB",
              "src_format": "RGB"}]
    pulsar.build(tiny["model"], tmp_path / "out", {**tiny_config, "input_processors": procs,
                                                    "evaluation": {"metric": f"{plugin}:mean_logit"}}, quiet=True)
    got = json.loads((tmp_path / "out" / "evaluation.json").read_text())
    x = np.random.default_rng(0).integers(0, 256, (1, 16, 16, 3), dtype=np.uint8)
    fl = ort.InferenceSession(str(tiny["model"]), providers=["CPUExecutionProvider"])
    want = float(fl.run(None, {"image": x.transpose(0, 3, 1, 2).astype(np.float32)})[0].mean())
    assert got["float"] == pytest.approx(want, rel=1e-5)
    assert got["npu"] == pytest.approx(got["qdq"], abs=0.05)


BAD_PLUGINS = {
    "missing module": ("no_such_module_xyz:fn", "module 'no_such_module_xyz' not found"),
    "missing function": ("{plugin}:nope", "has no function 'nope'"),
    "wrong signature": ("{plugin}:two_args", "cannot be called with one argument"),
    "raising": ("{plugin}:boom", "boom() raised RuntimeError on the float model: bad data"),
    "NaN": ("{plugin}:nan", "nan() returned nan on the float model"),
    "not a number": ("{plugin}:text", "returned str 'high' on the float model, not a number"),
    "unknown built-in": ("top3", "'top3' is not a built-in metric"),
    "sys.exit at import": ("{exits}:m", "importing {exits} raised SystemExit"),
}


@pytest.mark.parametrize("case", sorted(BAD_PLUGINS))
def test_bad_metrics_are_one_error_line(tiny, tiny_config, tmp_path, case: str) -> None:
    plugin = tmp_path / "plug.py"
    plugin.write_text("def two_args(a, b):\n    return 1.0\n"
                      "def boom(s):\n    raise RuntimeError('bad data')\n"
                      "def nan(s):\n    return float('nan')\n"
                      "def text(s):\n    return 'high'\n")
    exits = tmp_path / "exits.py"
    exits.write_text("import sys\nsys.exit(3)\n")
    spec, needle = (t.format(plugin=plugin, exits=exits) for t in BAD_PLUGINS[case])
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({**tiny_config, "evaluation": {"metric": spec}}))
    proc = run_pulsar(["build", "--input", str(tiny["model"]), "--config",
                      str(cfg), "--output_dir", str(tmp_path / "out")], timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0] and "evaluation.metric" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "compiled.pulsar").exists()
    assert not (tmp_path / "__pycache__").exists()  # importing the plugin file left nothing beside it


def test_top1_labels_must_be_class_indices(tiny, tiny_config, evalset, tmp_path) -> None:
    onehot = np.eye(10, dtype=np.float32)[evalset["y"]]  # perfect one-hot labels would score 0 if read as indices
    for name, labels in (("onehot", onehot), ("float", evalset["y"].astype(np.float32))):
        np.save(tmp_path / f"{name}.npy", labels)
        cfg = _config(tiny_config, evalset, "top1", labels=str(tmp_path / f"{name}.npy"))
        with pytest.raises(PulsarError, match=r"evaluation.labels: .* needs one integer class index per sample"):
            pulsar.build(tiny["model"], tmp_path / name, cfg, quiet=True)
        assert not (tmp_path / name).exists()
    np.save(tmp_path / "column.npy", evalset["y"][:, None])  # [N, 1] integer labels are fine
    pulsar.build(tiny["model"], tmp_path / "column", _config(tiny_config, evalset, "top1",
                                                              labels=str(tmp_path / "column.npy")), quiet=True)


def test_evaluation_settings_without_a_metric_or_labels_are_refused(tiny, tiny_config, evalset, tmp_path) -> None:
    with pytest.raises(PulsarError, match="evaluation.labels: the metric top1 needs labels"):
        pulsar.build(tiny["model"], tmp_path / "a", _config(tiny_config, evalset, "top1"), quiet=True)
    with pytest.raises(PulsarError, match="evaluation.labels is set but evaluation.metric is empty"):
        pulsar.build(tiny["model"], tmp_path / "b", {**tiny_config, "evaluation": {"labels": "x.npy"}}, quiet=True)
    with pytest.raises(PulsarError, match="evaluation.output: the model has no output 'prob'"):
        pulsar.build(tiny["model"], tmp_path / "c", _config(tiny_config, evalset, "cosine", output="prob"),
                     quiet=True)
