"""Tensor files of `pulsar run`: names, .npy / .bin reading, random feeds, outputs, list files."""

from __future__ import annotations

import numpy as np
import pytest

from pulsar.core.tensor_io import random_inputs, read_inputs, tensor_file_stem, write_outputs
from pulsar.errors import PulsarError
from pulsar.runtime import TensorInfo
from pulsar.runtime.paths import read_list_file

IMAGES = TensorInfo("images:0/x", (1, 3, 4, 4), np.dtype(np.float32))
IDS = TensorInfo("ids", (2, 5), np.dtype(np.int64))


def test_tensor_file_stem():
    assert tensor_file_stem("images:0/x") == "images_0_x"
    assert tensor_file_stem("a-b_C9") == "a-b_C9"
    assert tensor_file_stem("x.y z") == "x_y_z"


def test_read_npy_and_bin(tmp_path):
    images = np.random.default_rng(0).standard_normal(IMAGES.shape).astype(np.float32)
    ids = np.arange(10, dtype=np.int64).reshape(2, 5)
    np.save(tmp_path / "images_0_x.npy", images)
    (tmp_path / "ids.bin").write_bytes(ids.astype("<i8").tobytes())
    feeds = read_inputs(tmp_path, [IMAGES, IDS])
    assert list(feeds) == ["images:0/x", "ids"]
    np.testing.assert_array_equal(feeds["images:0/x"], images)
    np.testing.assert_array_equal(feeds["ids"], ids)
    assert feeds["ids"].dtype == np.int64


def test_npy_float64_is_cast_to_float32(tmp_path):
    np.save(tmp_path / "images_0_x.npy", np.ones(IMAGES.shape))  # numpy's default float64
    feeds = read_inputs(tmp_path, [IMAGES])
    assert feeds["images:0/x"].dtype == np.float32


def test_npy_dtype_and_shape_errors(tmp_path):
    np.save(tmp_path / "ids.npy", np.zeros((2, 5), np.int32))
    with pytest.raises(PulsarError, match=r'ids.npy: input "ids" expects dtype int64, the file holds int32'):
        read_inputs(tmp_path, [IDS])
    np.save(tmp_path / "ids.npy", np.zeros((5, 2), np.int64))
    with pytest.raises(PulsarError, match=r"expects shape \(2, 5\), the file holds \(5, 2\)"):
        read_inputs(tmp_path, [IDS])


def test_npy_with_pickled_objects_is_refused(tmp_path):
    np.save(tmp_path / "ids.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(PulsarError, match="not a plain numeric .npy"):
        read_inputs(tmp_path, [IDS])


def test_bin_size_errors(tmp_path):
    (tmp_path / "ids.bin").write_bytes(b"\0" * 79)
    with pytest.raises(PulsarError, match=r"needs exactly 80 bytes, the file has 79"):
        read_inputs(tmp_path, [IDS])
    (tmp_path / "ids.bin").write_bytes(b"\0" * 88)
    with pytest.raises(PulsarError, match=r"needs exactly 80 bytes, the file has 88"):
        read_inputs(tmp_path, [IDS])


def test_bin_with_a_dynamic_dimension(tmp_path):
    info = TensorInfo("x", (-1, 3), np.dtype(np.float32))
    data = np.arange(12, dtype=np.float32).reshape(4, 3)
    (tmp_path / "x.bin").write_bytes(data.tobytes())
    np.testing.assert_array_equal(read_inputs(tmp_path, [info])["x"], data)
    (tmp_path / "x.bin").write_bytes(data.tobytes()[:-4])
    with pytest.raises(PulsarError, match="not a whole number"):
        read_inputs(tmp_path, [info])


def test_missing_file_lists_expected_names(tmp_path):
    np.save(tmp_path / "images_0_x.npy", np.zeros(IMAGES.shape, np.float32))
    with pytest.raises(PulsarError, match=r'no file for input "ids" \(ids.npy or ids.bin\)') as exc:
        read_inputs(tmp_path, [IMAGES, IDS])
    msg = str(exc.value)
    assert str(tmp_path) in msg and "images_0_x.npy" in msg and "\n" not in msg


def test_both_npy_and_bin_is_ambiguous(tmp_path):
    np.save(tmp_path / "ids.npy", np.zeros((2, 5), np.int64))
    (tmp_path / "ids.bin").write_bytes(b"\0" * 80)
    with pytest.raises(PulsarError, match="both ids.npy and ids.bin"):
        read_inputs(tmp_path, [IDS])


def test_missing_input_dir(tmp_path):
    with pytest.raises(PulsarError, match="does not exist"):
        read_inputs(tmp_path / "nope", [IDS])


def test_random_inputs():
    infos = [
        IMAGES,
        TensorInfo("q", (1000,), np.dtype(np.int8)),
        IDS,
        TensorInfo("dyn", (-1, 2), np.dtype(np.float16)),
        TensorInfo("mask", (3,), np.dtype(bool)),
    ]
    a, b = random_inputs(infos, seed=7), random_inputs(infos, seed=7)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    assert not np.array_equal(a["images:0/x"], random_inputs(infos, seed=8)["images:0/x"])
    assert {k: (v.shape, v.dtype) for k, v in a.items()} == {
        "images:0/x": ((1, 3, 4, 4), np.float32),
        "q": ((1000,), np.int8),
        "ids": ((2, 5), np.int64),
        "dyn": ((1, 2), np.float16),
        "mask": ((3,), np.bool_),
    }
    assert a["q"].min() < -100 and a["q"].max() > 100  # spans the int8 range
    assert a["ids"].min() >= 0 and a["ids"].max() <= 255


def test_write_outputs(tmp_path):
    out = {"logits:0": np.arange(6, dtype=np.float32).reshape(2, 3), "logits_0": np.ones(2, np.int64)}
    paths = write_outputs(tmp_path / "out", out)
    assert [p.name for p in paths] == ["logits_0.npy", "logits_0_1.npy"]
    np.testing.assert_array_equal(np.load(paths[0]), out["logits:0"])
    np.testing.assert_array_equal(np.load(paths[1]), out["logits_0"])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["logits_0.npy", "logits_0_1.npy"]


def test_list_file(tmp_path):
    data = tmp_path / "data"
    (data / "s0").mkdir(parents=True)
    absolute = tmp_path / "elsewhere" / "s1"
    absolute.mkdir(parents=True)
    lst = tmp_path / "list.txt"
    lst.write_text(f"# samples\ns0\n\n  {absolute}  \n# end\n")
    assert read_list_file(lst, data) == [data / "s0", absolute]

    lst.write_text("s0\n# comment\ns2\n")
    with pytest.raises(PulsarError, match=r"list.txt:3: sample directory .*s2 does not exist"):
        read_list_file(lst, data)

    lst.write_text("# nothing\n\n")
    with pytest.raises(PulsarError, match="lists no sample directories"):
        read_list_file(lst, data)
    with pytest.raises(PulsarError, match="list file .* does not exist"):
        read_list_file(tmp_path / "missing.txt", data)
