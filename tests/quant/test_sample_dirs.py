"""quant.input_sample_dir and compiler.input_sample_dir: one reader, one format (the deployed input,
what `pulsar run` takes), converted through input_processors for the precision analysis; a bad file is
one PulsarError naming the field, the file and the tensor."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import pulsar
from pulsar.config import load_build_config
from pulsar.errors import PulsarError
from pulsar.frontend.loader import load_model
from pulsar.quant.samples import SampleDir, open_sample_dir

MEAN, STD = [10.0, 20.0, 30.0], [50.0, 60.0, 70.0]
PROCESSOR = {"tensor_name": "image", "tensor_format": "BGR", "src_format": "BGR", "src_layout": "NHWC",
             "src_dtype": "U8", "mean": MEAN, "std": STD}


@pytest.fixture()
def deployed_config(tiny_config: dict) -> dict:
    return {**tiny_config, "input_processors": [PROCESSOR]}


def _deployed_samples(root: Path, n: int = 3) -> Path:
    for i in range(n):
        (root / f"s{i}").mkdir(parents=True)
        raw = np.random.default_rng(i).integers(0, 256, (1, 16, 16, 3), dtype=np.uint8)
        np.save(root / f"s{i}" / "image.npy", raw)
    return root


def test_both_fields_take_the_same_deployed_samples(tmp_path, tiny, deployed_config):
    samples = _deployed_samples(tmp_path / "samples")
    out = tmp_path / "out"
    res = pulsar.build(tiny["model"], out, deployed_config, {
        "quant.precision_analysis": True, "quant.precision_analysis_method": "PerLayer",
        "quant.input_sample_dir": str(samples), "compiler.input_sample_dir": str(samples),
        "compiler.check": 3, "compiler.check_mode": "CheckPerLayer"}, quiet=True)
    log = (out / "build.log").read_text()
    assert "precision analysis (PerLayer): 9 layers over 3 samples" in log
    assert "compiler check 3 passed" in log and "over 3 samples" in log
    table = (out / "quant" / "debug" / "precision_analysis_table.txt").read_text()
    assert "fc " in table
    sess = pulsar.Session(res.compiled_model)
    assert sess.inputs[0].dtype == np.uint8 and sess.inputs[0].shape == (1, 16, 16, 3)


def test_npubackend_analysis_reads_deployed_samples(tmp_path, tiny, deployed_config):
    samples = _deployed_samples(tmp_path / "samples", n=2)
    out = tmp_path / "out"
    pulsar.build(tiny["model"], out, deployed_config, {
        "quant.precision_analysis": True, "quant.precision_analysis_method": "EndToEnd",
        "quant.precision_analysis_mode": "NPUBackend", "quant.input_sample_dir": str(samples),
        "compiler.check": 0}, quiet=True)
    assert "[EndToEnd NPUBackend]" in (out / "quant" / "debug" / "precision_analysis_table.txt").read_text()


def test_samples_go_through_the_input_processors(tmp_path, tiny, deployed_config):
    samples = _deployed_samples(tmp_path / "samples", n=2)
    cfg = load_build_config(deployed_config, {"input": str(tiny["model"]), "output_dir": str(tmp_path / "o")}).cfg
    model = load_model(tiny["model"])
    got = list(open_sample_dir("quant.input_sample_dir", samples, cfg, model))
    assert len(got) == 2
    raw = np.load(samples / "s1" / "image.npy")
    want = ((raw.astype(np.float32) - np.float32(MEAN)) / np.float32(STD)).transpose(0, 3, 1, 2)
    np.testing.assert_allclose(got[1]["image"], want, rtol=1e-6)
    assert got[1]["image"].dtype == np.float32 and got[1]["image"].shape == (1, 3, 16, 16)


def test_one_directory_is_one_sample(tmp_path, tiny, deployed_config):
    (tmp_path / "one").mkdir()
    np.save(tmp_path / "one" / "image.npy", np.zeros((1, 16, 16, 3), np.uint8))
    cfg = load_build_config(deployed_config, {"input": str(tiny["model"]), "output_dir": str(tmp_path / "o")}).cfg
    samples = open_sample_dir("quant.input_sample_dir", tmp_path / "one", cfg, load_model(tiny["model"]))
    assert len(samples) == 1 and isinstance(samples, SampleDir)


def _bad(kind: str, folder: Path) -> Path:
    folder.mkdir(parents=True)
    path = folder / "image.npy"
    if kind == "model_format":  # float32 NCHW: what calibration takes, not the deployed input
        np.save(path, np.zeros((1, 3, 16, 16), np.float32))
    elif kind == "shape":
        np.save(path, np.zeros((1, 16, 15, 3), np.uint8))
    elif kind == "unreadable":
        path.write_bytes(b"not a numpy file")
    elif kind == "raw_size":
        path = folder / "image.bin"
        path.write_bytes(b"\0" * 100)
    return path


@pytest.mark.parametrize("field", ["quant.input_sample_dir", "compiler.input_sample_dir"])
@pytest.mark.parametrize("kind", ["model_format", "shape", "unreadable", "raw_size"])
def test_a_bad_file_names_the_field_file_and_tensor(tmp_path, tiny, deployed_config, field, kind):
    samples = _deployed_samples(tmp_path / "samples", n=1)
    bad = _bad(kind, samples / "s9")
    with pytest.raises(PulsarError) as err:
        pulsar.build(tiny["model"], tmp_path / "out", deployed_config, {
            "quant.precision_analysis": True, field: str(samples), "compiler.check": 1}, quiet=True)
    msg = str(err.value)
    assert msg.startswith(f"{field}: ") and str(bad) in msg and '"image"' in msg and "\n" not in msg
    if kind == "model_format":
        assert "model's own input format" in msg and "uint8 [1, 16, 16, 3]" in msg


@pytest.mark.parametrize("field", ["quant.input_sample_dir", "compiler.input_sample_dir"])
def test_non_finite_float_samples_are_refused(tmp_path, tiny, tiny_config, field):
    """Without processors the deployed input is the model's float input: NaN / inf are refused."""
    (tmp_path / "s" / "a").mkdir(parents=True)
    x = np.zeros((1, 3, 16, 16), np.float32)
    x[0, 1, 2, 3] = np.nan
    np.save(tmp_path / "s" / "a" / "image.npy", x)
    with pytest.raises(PulsarError) as err:
        pulsar.build(tiny["model"], tmp_path / "out", tiny_config, {
            "quant.precision_analysis": True, field: str(tmp_path / "s"), "compiler.check": 1}, quiet=True)
    msg = str(err.value)
    assert msg.startswith(f"{field}: ") and "image.npy" in msg and '"image"' in msg
    assert "NaN" in msg or "non-finite" in msg


def test_effective_config_records_the_sample_dirs(tmp_path, tiny, deployed_config):
    samples = _deployed_samples(tmp_path / "samples", n=1)
    out = tmp_path / "out"
    pulsar.build(tiny["model"], out, deployed_config, {"compiler.input_sample_dir": str(samples),
                                                       "compiler.check": 1}, quiet=True)
    eff = json.loads((out / "build_config.json").read_text())
    assert eff["compiler"]["input_sample_dir"] == str(samples)
