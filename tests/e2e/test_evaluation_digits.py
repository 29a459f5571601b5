"""A real classifier scored by the built-in top-1 metric: a CNN trained here on scikit-learn's
handwritten digits (its 1797 labelled 8x8 images ship in the wheel), evaluated on held-out digits
with their true labels. The float, QDQ and NPUBackend figures in evaluation.json must equal those of
an independent evaluation script that shares no code with pulsar's evaluation: onnxruntime for the
float and QDQ models, ``pulsar run --list`` (files in, files out) for the compiled model."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.cli_fork import run_pulsar

N_TRAIN, N_EVAL = 1400, 300

SCRIPT = '''"""Independent top-1: argv = float.onnx qdq.onnx compiled.pulsar samples/ samples.txt labels.npy workdir."""
import json, subprocess, sys
from pathlib import Path
import numpy as np
import onnxruntime as ort

fl, qdq, compiled, samples, listing, labels, work = sys.argv[1:]
dirs = [Path(samples) / name for name in Path(listing).read_text().split()]
y = np.load(labels)
opts = ort.SessionOptions()
opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # Q/DQ as written, no fusion
top1 = {}
for key, path in (("float", fl), ("qdq", qdq)):
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    preds = [int(np.argmax(sess.run(None, {"digit": np.load(d / "digit.npy")})[0])) for d in dirs]
    top1[key] = float(np.mean(np.array(preds) == y))
out = Path(work) / "npu_out"
subprocess.run([sys.executable, "-m", "pulsar", "run", "--model", compiled, "--input_dir", samples, "--list", listing,
                "--output_dir", str(out), "--mode", "NPUBackend"], check=True, capture_output=True)
files = sorted(out.rglob("logits.npy"))
assert len(files) == len(dirs), (len(files), len(dirs))
preds = [int(np.argmax(np.load(f))) for f in files]
top1["npu"] = float(np.mean(np.array(preds) == y))
print(json.dumps(top1))
'''


def _train(x: np.ndarray, y: np.ndarray):
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 32, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(32 * 4 * 4, 10))
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for _ in range(12):
        for idx in torch.randperm(len(xt)).split(64):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(xt[idx]), yt[idx]).backward()
            opt.step()
    return net.eval()


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> dict:
    import torch
    from sklearn.datasets import load_digits

    root = tmp_path_factory.mktemp("digits")
    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]  # (1797, 1, 8, 8) in [0, 1]
    y = d.target.astype(np.int64)
    net = _train(x[:N_TRAIN], y[:N_TRAIN])
    model = root / "digits.onnx"
    # the legacy exporter: plain opset-17 ops, no external data
    torch.onnx.export(net, (torch.from_numpy(x[:1]),), str(model), input_names=["digit"], output_names=["logits"],
                      opset_version=17, dynamo=False)
    calib, evald = root / "calib", root / "eval"
    calib.mkdir()
    evald.mkdir()
    for i in range(32):
        np.save(calib / f"c{i:03d}.npy", x[i])
    listing = []
    for i in range(N_EVAL):
        xi = x[N_TRAIN + i][None]  # (1, 1, 8, 8)
        np.save(evald / f"e{i:04d}.npy", xi)
        sample = root / "samples" / f"{i:04d}"
        sample.mkdir(parents=True)
        np.save(sample / "digit.npy", xi)
        listing.append(sample.name)
    np.save(root / "labels.npy", y[N_TRAIN:N_TRAIN + N_EVAL])
    (root / "samples.txt").write_text("\n".join(listing) + "\n")
    (root / "evaluate.py").write_text(SCRIPT)
    return {"model": model, "calib": calib, "eval": evald, "labels": root / "labels.npy", "root": root}


@pytest.mark.slow
def test_a_trained_digit_classifier_top1_matches_an_independent_script(digits, tmp_path) -> None:
    cfg = {"quant": {"input_configs": [{"tensor_name": "digit", "calibration_dataset": str(digits["calib"]),
                                        "calibration_format": "Numpy", "calibration_size": -1}]},
           "evaluation": {"metric": "top1", "labels": str(digits["labels"]), "input_configs": [
               {"tensor_name": "digit", "calibration_dataset": str(digits["eval"]), "calibration_format": "Numpy",
                "calibration_size": -1}]}}
    config = tmp_path / "config.json"
    config.write_text(json.dumps(cfg))
    out = tmp_path / "out"
    build = run_pulsar(["build", "--input", str(digits["model"]), "--config",
                       str(config), "--output_dir", str(out)], timeout=600)
    assert build.returncode == 0, build.stderr
    got = json.loads((out / "evaluation.json").read_text())
    assert got["metric"] == "top1" and got["samples"] == N_EVAL
    indep = subprocess.run([sys.executable, str(digits["root"] / "evaluate.py"), str(digits["model"]),
                            str(out / "quant" / "quantized.onnx"), str(out / "compiled.pulsar"),
                            str(digits["root"] / "samples"), str(digits["root"] / "samples.txt"), str(digits["labels"]), str(tmp_path)],
                           capture_output=True, text=True, timeout=600)
    assert indep.returncode == 0, indep.stderr
    want = json.loads(indep.stdout)
    for k in ("float", "qdq", "npu"):
        assert got[k] == pytest.approx(want[k], abs=1e-12), (k, got, want)
    assert got["float"] > 0.9  # a real classifier on held-out digits, not chance (0.1)
    assert got["npu"] > got["float"] - 0.03  # and quantization keeps it
    for k, name in (("float", "float model"), ("qdq", "QDQ model"), ("npu", "compiled model (NPUBackend)")):
        assert name in build.stdout + build.stderr
        assert f"evaluation top1: {k} {got[k]:.6f}" in (out / "build.log").read_text()
