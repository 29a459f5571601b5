"""``run_model`` (pulsar run) on a real compiled model: list output directories, checks before anything
runs, --batch_size hints and memory check, input file errors."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import pulsar
from pulsar.errors import PulsarError
from pulsar.runtime import Session
from pulsar.runtime.paths import read_sample_list
from pulsar.runtime.runner import run_model

SHAPE = (1, 3, 16, 16)


@pytest.fixture(scope="module")
def model(tiny, tmp_path_factory) -> Path:
    cfg = {"quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                                        "calibration_format": "Numpy", "calibration_size": 8}]}}
    return pulsar.build(tiny["model"], tmp_path_factory.mktemp("runner") / "out", cfg, quiet=True).compiled_model


def _sample(folder: Path, seed: int, shape=SHAPE) -> np.ndarray:
    folder.mkdir(parents=True, exist_ok=True)
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    np.save(folder / "image.npy", x)
    return x


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def _error(**kwargs) -> str:
    with pytest.raises(PulsarError) as exc:
        run_model(**kwargs)
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_list_entries_get_distinct_directories_inside_output_dir(model, tmp_path):
    data = tmp_path / "data"
    inputs = data / "inputs"
    xs = {
        "a/s1": _sample(inputs / "a" / "s1", 1),
        "b/s1": _sample(inputs / "b" / "s1", 2),
        "..": _sample(data, 3),  # the parent of --input_dir: its name must not become a path
        "S1": _sample(inputs / "S1", 4),  # same name but for case: distinct on any file system
        "s2": _sample(inputs / "s2", 5),
    }
    listing = tmp_path / "list.txt"
    listing.write_text("a/s1\nb/s1\n..\n# comment\nS1\ns2\ns2\n")
    before = _files(tmp_path)
    out = tmp_path / "out"
    result = run_model(model, out, input_dir=inputs, list_file=listing)
    names = [d.name for d in result.sample_dirs]
    assert names == ["s1", "s1_line2", "sample_line3", "S1_line5", "s2", "s2_line7"]
    assert all(d.parent == out for d in result.sample_dirs)
    session = Session(model)
    for entry, name in zip([*xs, "s2"], names, strict=True):
        want = session.run({"image": xs[entry]})["logits"]
        np.testing.assert_array_equal(np.load(out / name / "logits.npy"), want)
    # nothing outside --output_dir
    assert _files(tmp_path) - before == {f"out/{n}/logits.npy" for n in names}
    assert result.samples == 6 and result.outputs == [("logits", (1, 10), np.dtype(np.float32))]
    assert [(e.line, e.output_name) for e in read_sample_list(listing, inputs)][:2] == [(1, "s1"), (2, "s1_line2")]


def test_output_dir_problems_are_found_before_anything_is_written(model, tmp_path):
    _sample(tmp_path / "in", 0)
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert "exists and is not a directory" in _error(model=model, output_dir=afile, input_dir=tmp_path / "in")
    msg = _error(model=model, output_dir=afile / "sub" / "deeper", input_dir=tmp_path / "in")
    assert "--output_dir" in msg and f"{afile} is a file, not a directory" in msg
    msg = _error(model=model, output_dir="/proc/pulsar-test/out", input_dir=tmp_path / "in")
    assert "--output_dir /proc/pulsar-test/out cannot be created" in msg
    assert _files(tmp_path) == {"afile", "in/image.npy"}


def test_failed_run_removes_the_directories_it_created(model, tmp_path):
    (tmp_path / "in").mkdir()
    np.save(tmp_path / "in" / "image.npy", np.zeros(SHAPE, np.int32))
    out = tmp_path / "new" / "nested" / "out"
    assert "dtype" in _error(model=model, output_dir=out, input_dir=tmp_path / "in")
    assert not (tmp_path / "new").exists()


def test_bad_sample_late_in_the_list_fails_before_any_output(model, tmp_path):
    _sample(tmp_path / "in" / "s0", 0)
    _sample(tmp_path / "in" / "s1", 1)
    _sample(tmp_path / "in" / "s2", 2, shape=(1, 3, 8, 8))
    (tmp_path / "l.txt").write_text("s0\ns1\ns2\n")
    msg = _error(model=model, output_dir=tmp_path / "out", input_dir=tmp_path / "in", list_file=tmp_path / "l.txt")
    assert "s2" in msg and "expects shape (1, 3, 16, 16)" in msg
    assert not (tmp_path / "out").exists()


def test_list_file_problems(model, tmp_path):
    _sample(tmp_path / "in" / "s0", 0)
    kw = dict(model=model, output_dir=tmp_path / "out", input_dir=tmp_path / "in")
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"s0\ncaf\xe9\n")
    msg = _error(**kw, list_file=bad)
    assert "--list" in msg and "latin1.txt:2" in msg and "byte 6 (0xe9) is not UTF-8" in msg
    assert "is a directory" in _error(**kw, list_file=tmp_path / "in")
    assert "--list file" in _error(**kw, list_file=tmp_path / "nope.txt")
    nul = tmp_path / "nul.txt"
    nul.write_bytes(b"s0\ns\x000\n")
    assert "nul.txt:2: the entry holds a control character (\\x00)" in _error(**kw, list_file=nul)
    assert "--list needs --input_dir" in _error(model=model, output_dir=tmp_path / "out", list_file=nul)


@pytest.mark.parametrize(("flag", "value", "needle"), [
    ("output_dir", "out\x1b[2Jx", "--output_dir 'out\\x1b[2Jx' contains a control character (\\x1b)"),
    ("model", "m\x00odel.pulsar", "--model 'm\\x00odel.pulsar' contains a NUL byte at position 1"),
    ("input_dir", "in\nput", "--input_dir 'in\\nput' contains a control character (\\n)"),
])
def test_control_characters_in_paths(model, tmp_path, flag, value, needle):
    kw = {"model": model, "output_dir": tmp_path / "out", "input_dir": tmp_path, flag: value}
    assert needle in _error(**kw)


def test_batch_size_problems_and_hints(model, tmp_path):
    kw = dict(model=model, output_dir=tmp_path / "out")
    assert "--batch_size must be at least 1, got 0" in _error(**kw, random_input=True, batch_size=0)
    assert "--batch_size must be at least 1, got -2" in _error(**kw, random_input=True, batch_size=-2)
    msg = _error(**kw, random_input=True, batch_size=10**9)
    assert "--batch_size 1000000000 needs 3.11 TB" in msg and "MemAvailable" in msg and "available" in msg
    four = tmp_path / "four"
    x4 = _sample(four, 9, shape=(4, 3, 16, 16))
    msg = _error(**kw, input_dir=four)
    assert "image.npy" in msg and "the file holds 4 samples: run with --batch_size 4" in msg
    assert "the file holds 4 samples: run with --batch_size 4" in _error(**kw, input_dir=four, batch_size=2)
    raw = tmp_path / "raw"
    raw.mkdir()
    x4[:2].tofile(raw / "image.bin")
    assert "the file holds 2 samples: run with --batch_size 2" in _error(**kw, input_dir=raw)
    result = run_model(model, tmp_path / "out4", input_dir=four, batch_size=4)
    got = np.load(tmp_path / "out4" / "logits.npy")
    session = Session(model)
    want = np.concatenate([session.run({"image": x4[i:i + 1]})["logits"] for i in range(4)])
    np.testing.assert_array_equal(got, want)
    assert result.samples == 4


def test_input_file_problems_name_file_and_tensor(model, tmp_path):
    d = tmp_path / "in"
    x = _sample(d, 0)
    x[0, 1, 2, 3] = np.nan
    x[0, 2, 0, 0] = np.inf
    np.save(d / "image.npy", x)
    msg = _error(model=model, output_dir=tmp_path / "out", input_dir=d)
    assert str(d / "image.npy") in msg and '"image"' in msg
    assert "2 non-finite value(s)" in msg and "(0, 1, 2, 3)" in msg
    np.save(d / "image.npy", np.zeros(SHAPE, np.uint8))
    msg = _error(model=model, output_dir=tmp_path / "out", input_dir=d)
    assert 'input "image" expects dtype float32, the file holds uint8' in msg
    np.save(d / "image.npy", np.zeros(SHAPE, ">f4"))  # big-endian float32 is the same numbers
    run_model(model, tmp_path / "out", input_dir=d)
    assert not os.path.exists(tmp_path / "out" / "image.npy")
