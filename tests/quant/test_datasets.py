"""Calibration datasets: every format from every source kind, safety checks, matching and streaming."""

from __future__ import annotations

import io
import logging
import os
import pickle
import stat
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pulsar.errors import PulsarError
from pulsar.quant.datasets import (
    FORMATS,
    CalibrationData,
    DatasetConfig,
    InputSpec,
    load_numpy_object,
)

SOURCE_KINDS = ["dir", "tar", "tar.gz", "zip"]


# -- helpers ----------------------------------------------------------------------------------------
def pack(src: Path, kind: str) -> Path:
    """Return ``src`` itself or an archive of its files (relative names) next to it."""
    if kind == "dir":
        return src
    dest = src.parent / f"{src.name}.{kind}"
    files = sorted(p for p in src.rglob("*") if p.is_file())
    if kind == "zip":
        with zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as zf:
            for p in files:
                zf.write(p, p.relative_to(src).as_posix())
    else:
        with tarfile.open(dest, "w:gz" if kind == "tar.gz" else "w") as tf:
            for p in files:
                tf.add(p, p.relative_to(src).as_posix())
    return dest


def tar_with(dest: Path, entries: list[tarfile.TarInfo | tuple[str, bytes]]) -> Path:
    with tarfile.open(dest, "w") as tf:
        for entry in entries:
            if isinstance(entry, tarfile.TarInfo):
                tf.addfile(entry)
            else:
                name, data = entry
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return dest


def npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def save_object(path: Path, obj: object) -> Path:
    np.save(path, obj, allow_pickle=True)  # exactly how users make NumpyObject files
    return path


def calib(inputs: list[InputSpec], *configs: DatasetConfig) -> CalibrationData:
    return CalibrationData(inputs, list(configs))


def photos() -> dict[str, np.ndarray]:
    data = pytest.importorskip("skimage.data")
    return {"astronaut": data.astronaut(), "chelsea": data.chelsea()}


def reference_image(path: Path, fmt: str, layout: str, h: int, w: int, mean, std) -> np.ndarray:
    """Independent preprocessing: PIL bilinear resize, then numpy channel order / normalisation."""
    img = Image.open(path).convert("L" if fmt == "GRAY" else "RGB").resize((w, h), Image.BILINEAR)
    a = np.array(img, dtype=np.float64)
    a = a[:, :, None] if a.ndim == 2 else a
    if fmt == "BGR":
        a = a[:, :, [2, 1, 0]]
    a = (a - np.array(mean or [0.0])) / np.array(std or [1.0])
    if layout == "NCHW":
        a = np.moveaxis(a, -1, 0)
    return a[None]


# -- every format from every source ------------------------------------------------------------------
def _dataset(tmp_path: Path, fmt: str) -> tuple[Path, InputSpec, dict[str, np.ndarray]]:
    """Three samples of one format in tmp_path/data, with the arrays the reader must return."""
    src = tmp_path / "data"
    (src / "sub").mkdir(parents=True)
    rng = np.random.default_rng(0)
    expected: dict[str, np.ndarray] = {}
    if fmt == "Image":
        spec = InputSpec("x", (1, 3, 12, 10), np.float32, "RGB", "NCHW")
        for i, (name, arr) in enumerate(photos().items()):
            Image.fromarray(arr).save(src / f"{name}.png")
            expected[name] = reference_image(src / f"{name}.png", "RGB", "NCHW", 12, 10, [], [])
            if i == 0:
                Image.fromarray(arr[:100, :80]).save(src / "sub" / "crop.png")
                expected["sub/crop"] = reference_image(
                    src / "sub" / "crop.png", "RGB", "NCHW", 12, 10, [], []
                )
        return src, spec, expected
    spec = InputSpec("x", (1, 4, 5), np.float32)
    for name in ["s0", "s1", "sub/s2"]:
        arr = rng.standard_normal((1, 4, 5)).astype(np.float32)
        expected[name] = arr
        path = src / f"{name}.{'bin' if fmt == 'Binary' else 'npy'}"
        if fmt == "Binary":
            arr.tofile(path)
        elif fmt == "Numpy":
            np.save(path, arr)
        else:
            save_object(path, {"x": arr})
    return src, spec, expected


@pytest.mark.parametrize("kind", SOURCE_KINDS)
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_format_from_every_source(tmp_path: Path, fmt: str, kind: str) -> None:
    src, spec, expected = _dataset(tmp_path, fmt)
    (src / "notes.txt").write_text("not data")  # wrong extension: ignored
    dataset = pack(src, kind)
    with calib([spec], DatasetConfig("DEFAULT", str(dataset), fmt, -1)) as data:
        assert len(data) == len(expected)
        assert data.sample_names() == sorted(expected)
        got = list(data)
    assert len(got) == len(expected)
    for name, sample in zip(sorted(expected), got, strict=True):
        assert list(sample) == ["x"]
        arr = sample["x"]
        assert arr.shape == spec.shape and arr.dtype == spec.dtype
        np.testing.assert_allclose(arr, expected[name], rtol=1e-6, atol=1e-4)


# -- Image preprocessing -----------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("fmt", ["RGB", "BGR", "GRAY"])
@pytest.mark.parametrize("ext", ["jpg", "png"])
def test_image_matches_independent_preprocessing(tmp_path: Path, fmt: str, layout: str, ext: str) -> None:
    src = tmp_path / "imgs"
    src.mkdir()
    for name, arr in photos().items():
        Image.fromarray(arr).save(src / f"{name}.{ext}")
    c = 1 if fmt == "GRAY" else 3
    h, w = 48, 40
    shape = (1, c, h, w) if layout == "NCHW" else (1, h, w, c)
    mean = [123.675, 116.28, 103.53][:c]
    std = [58.395, 57.12, 57.375][:c]
    spec = InputSpec("img", shape, np.float32, fmt, layout)
    with calib([spec], DatasetConfig("img", str(src), "Image", 2, mean, std)) as data:
        samples = list(data)
    assert [s["img"].shape for s in samples] == [shape, shape]
    for name, sample in zip(["astronaut", "chelsea"], samples, strict=True):
        want = reference_image(src / f"{name}.{ext}", fmt, layout, h, w, mean, std)
        assert sample["img"].dtype == np.float32
        np.testing.assert_allclose(sample["img"], want, rtol=1e-5, atol=1e-4)


def test_image_without_resize_is_the_exact_photo(tmp_path: Path) -> None:
    """Lossless PNG at its own size: the tensor is the original pixels, in the requested order."""
    photo = photos()["chelsea"]  # (300, 451, 3) RGB
    h, w = photo.shape[:2]
    Image.fromarray(photo).save(tmp_path / "cat.png")
    specs = [
        InputSpec("rgb", (1, 3, h, w), np.float32, "RGB", "NCHW"),
        InputSpec("bgr", (1, h, w, 3), np.float64, "BGR", "NHWC"),
        InputSpec("gray", (1, 1, h, w), np.float32, "GRAY", "NCHW"),
    ]
    with calib(specs, DatasetConfig("DEFAULT", str(tmp_path), "Image")) as data:
        (sample,) = list(data)
    np.testing.assert_array_equal(sample["rgb"][0], photo.transpose(2, 0, 1).astype(np.float32))
    assert sample["bgr"].dtype == np.float64
    np.testing.assert_array_equal(sample["bgr"][0], photo[:, :, ::-1])
    luma = photo.astype(np.float64) @ np.array([0.299, 0.587, 0.114])  # ITU-R 601-2
    assert np.abs(sample["gray"][0, 0] - luma).max() <= 1.0


def test_image_needs_float_input_and_matching_channels(tmp_path: Path) -> None:
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "a.png")
    cfg = DatasetConfig("x", str(tmp_path), "Image", field_path="quant.input_configs[2]")
    with pytest.raises(PulsarError, match=r"quant\.input_configs\[2\].*'x'.*uint8.*Numpy or Binary"):
        calib([InputSpec("x", (1, 3, 8, 8), np.uint8)], cfg)
    with pytest.raises(PulsarError, match="tensor_format GRAY has 1"):
        calib([InputSpec("x", (1, 3, 8, 8), np.float32, "GRAY")], cfg)
    bad_mean = DatasetConfig("x", str(tmp_path), "Image", calibration_mean=[1.0, 2.0])
    with pytest.raises(PulsarError, match="calibration_mean has 2 values"):
        calib([InputSpec("x", (1, 3, 8, 8), np.float32)], bad_mean)


def test_corrupt_image_names_the_member(tmp_path: Path) -> None:
    src = tmp_path / "d"
    src.mkdir()
    (src / "broken.jpg").write_bytes(b"this is not a jpeg")
    archive = pack(src, "zip")
    spec = InputSpec("x", (1, 3, 4, 4), np.float32)
    with (
        calib([spec], DatasetConfig("x", str(archive))) as data,
        pytest.raises(PulsarError, match=r"d\.zip:broken\.jpg: cannot decode image"),
    ):
        list(data)


# -- Numpy / Binary / NumpyObject checks --------------------------------------------------------------
def test_numpy_dtype_and_shape_rules(tmp_path: Path) -> None:
    spec = InputSpec("feat", (1, 2, 3), np.float32)
    cfg = DatasetConfig("feat", str(tmp_path), "Numpy")

    np.save(tmp_path / "a.npy", np.arange(6, dtype=np.float64).reshape(2, 3))  # no batch, float64
    with calib([spec], cfg) as data:
        (sample,) = list(data)
    assert sample["feat"].dtype == np.float32 and sample["feat"].shape == (1, 2, 3)
    np.testing.assert_array_equal(sample["feat"].ravel(), np.arange(6))

    np.save(tmp_path / "a.npy", np.zeros((1, 2, 3), np.int32))
    with calib([spec], cfg) as data, pytest.raises(PulsarError) as err:
        list(data)
    assert all(s in str(err.value) for s in ["a.npy", "'feat'", "float32", "int32"])

    np.save(tmp_path / "a.npy", np.zeros((1, 3, 2), np.float32))
    with calib([spec], cfg) as data, pytest.raises(PulsarError) as err:
        list(data)
    assert all(s in str(err.value) for s in ["a.npy", "'feat'", "[1, 2, 3]", "[1, 3, 2]"])

    save_object(tmp_path / "a.npy", {"feat": np.zeros((1, 2, 3), np.float32)})
    with calib([spec], cfg) as data, pytest.raises(PulsarError, match="use calibration_format NumpyObject"):
        list(data)


def test_binary_size_mismatch(tmp_path: Path) -> None:
    np.zeros(5, np.float32).tofile(tmp_path / "a.bin")
    spec = InputSpec("x", (1, 2, 3), np.float32)
    with (
        calib([spec], DatasetConfig("x", str(tmp_path), "Binary")) as data,
        pytest.raises(PulsarError, match=r"a\.bin: input 'x' expects 24 bytes.*has 20"),
    ):
        list(data)
    with pytest.raises(PulsarError, match="dynamic shape"):
        calib([InputSpec("x", (-1, 2, 3), np.float32)], DatasetConfig("x", str(tmp_path), "Binary"))


def test_numpy_object_feeds_several_inputs_and_checks_keys(tmp_path: Path) -> None:
    specs = [InputSpec("a", (1, 3), np.float32), InputSpec("b", (2,), np.int64)]
    cfg = DatasetConfig("DEFAULT", str(tmp_path), "NumpyObject")
    save_object(tmp_path / "0.npy", {"a": np.ones((3,), np.float32), "b": np.array([4, 5])})
    with calib(specs, cfg) as data:
        (sample,) = list(data)
    assert sample["a"].shape == (1, 3) and sample["b"].tolist() == [4, 5]

    save_object(tmp_path / "0.npy", {"a": np.ones((1, 3), np.float32)})
    with calib(specs, cfg) as data, pytest.raises(PulsarError, match=r"0\.npy: missing keys \['b'\]"):
        list(data)
    save_object(tmp_path / "0.npy", {"a": np.ones(3, np.float32), "b": np.ones(2, np.int64), "c": np.ones(1)})
    with calib(specs, cfg) as data, pytest.raises(PulsarError, match=r"unexpected keys \['c'\]"):
        list(data)
    save_object(tmp_path / "0.npy", {"a": np.ones((1, 4), np.float32), "b": np.ones(2, np.int64)})
    with (
        calib(specs, cfg) as data,
        pytest.raises(PulsarError, match=r"'a' expects shape \[1, 3\], got \[1, 4\]"),
    ):
        list(data)


class _Payload:
    """Pickles as a call to os.system: what a hostile NumpyObject file would hold."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return (os.system, (f"echo pwned > {self.target}",))


def test_numpy_object_pickle_cannot_run_code(tmp_path: Path) -> None:
    # Control: the crafted file really runs a command when loaded the unsafe way.
    control_target = tmp_path / "control_pwned"
    control = save_object(tmp_path / "control.npy", {"x": _Payload(control_target)})
    np.load(control, allow_pickle=True)
    assert control_target.exists()

    data_dir = tmp_path / "calib"
    data_dir.mkdir()
    target = tmp_path / "pwned"
    save_object(data_dir / "evil.npy", {"x": _Payload(target)})
    spec = InputSpec("x", (1,), np.float32)
    with (
        calib([spec], DatasetConfig("x", str(data_dir), "NumpyObject")) as data,
        pytest.raises(PulsarError) as err,
    ):
        list(data)
    assert "evil.npy" in str(err.value) and f"{os.system.__module__}.system" in str(err.value)
    assert "forbidden global" in str(err.value)
    assert not target.exists()

    payload = pickle.dumps({"x": _Payload(target)}, protocol=4)  # a bare pickle behind a valid header
    header = npy_bytes(np.empty((), dtype=object))[:128]
    with pytest.raises(PulsarError, match="forbidden global"):
        load_numpy_object(header + payload, "raw.npy")
    assert not target.exists()


def test_numpy_object_from_numpy1_style_pickle() -> None:
    """numpy 1.x writes protocol 3 pickles naming numpy.core.multiarray; they load too."""
    value = np.empty((), dtype=object)
    value[()] = {"a": np.arange(4, dtype=np.int16).reshape(2, 2), "s": np.float32(2.5)}
    text = pickle.dumps(value, protocol=3)
    assert b"numpy._core.multiarray\n" in text or b"numpy.core.multiarray\n" in text
    text = text.replace(b"numpy._core.multiarray\n", b"numpy.core.multiarray\n")
    stream = io.BytesIO(npy_bytes(np.empty((), dtype=object)))
    np.lib.format.read_magic(stream)
    np.lib.format.read_array_header_1_0(stream)
    out = load_numpy_object(stream.getvalue()[: stream.tell()] + text, "old.npy")
    assert out["a"].dtype == np.int16 and out["a"].tolist() == [[0, 1], [2, 3]]
    assert out["s"].shape == () and float(out["s"]) == 2.5


def test_numpy_object_rejects_plain_arrays_and_garbage() -> None:
    with pytest.raises(PulsarError, match="plain float32 array"):
        load_numpy_object(npy_bytes(np.zeros(3, np.float32)), "plain.npy")
    with pytest.raises(PulsarError, match="not a valid .npy"):
        load_numpy_object(b"garbage", "g.npy")
    truncated = io.BytesIO()
    np.save(truncated, {"a": np.zeros(100)}, allow_pickle=True)
    with pytest.raises(PulsarError, match="t.npy: corrupt NumpyObject"):
        load_numpy_object(truncated.getvalue()[:-50], "t.npy")


# -- archive safety ----------------------------------------------------------------------------------
def _link(name: str, kind: bytes, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    return info


@pytest.mark.parametrize(
    "entry, why",
    [
        (("../evil.npy", b"x"), "'..' path component"),
        (("data/../../evil.npy", b"x"), "'..' path component"),
        (("/abs/evil.npy", b"x"), "absolute path"),
        (_link("link.npy", tarfile.SYMTYPE, "/etc/passwd"), "link to '/etc/passwd'"),
        (_link("hard.npy", tarfile.LNKTYPE, "ok.npy"), "link to 'ok.npy'"),
        (_link("dev.npy", tarfile.CHRTYPE, ""), "device"),
    ],
)
def test_unsafe_tar_members_are_refused(tmp_path: Path, entry, why: str) -> None:
    archive = tar_with(tmp_path / "bad.tar", [("ok.npy", npy_bytes(np.zeros(1, np.float32))), entry])
    with pytest.raises(PulsarError) as err:
        calib([InputSpec("x", (1,), np.float32)], DatasetConfig("x", str(archive), "Numpy"))
    msg = str(err.value)
    assert "bad.tar" in msg and "unsafe member" in msg and why in msg
    assert not (tmp_path / "evil.npy").exists()


def test_unsafe_zip_members_are_refused(tmp_path: Path) -> None:
    for name, attr, why in [
        ("../evil.npy", 0, "'..'"),
        ("ln.npy", (stat.S_IFLNK | 0o777) << 16, "symbolic link"),
    ]:
        archive = tmp_path / "bad.zip"
        with zipfile.ZipFile(archive, "w") as zf:
            info = zipfile.ZipInfo(name)
            info.external_attr = attr
            zf.writestr(info, b"target")
        with pytest.raises(PulsarError, match=f"bad.zip: unsafe member '{name}'.*{why}"):
            calib([InputSpec("x", (1,), np.float32)], DatasetConfig("x", str(archive), "Numpy"))


# -- matching, sizes, validation ------------------------------------------------------------------------
def _two_inputs(tmp_path: Path, names_a: list[str], names_b: list[str]) -> tuple[list[InputSpec], list]:
    (tmp_path / "a").mkdir(parents=True)
    (tmp_path / "b").mkdir(parents=True)
    for n in names_a:
        np.full((1, 3), float(n), np.float32).tofile(tmp_path / "a" / f"{n}.bin")
    for n in names_b:
        np.save(tmp_path / "b" / f"{n}.npy", np.full((2,), int(n), np.int64))
    archive_b = pack(tmp_path / "b", "tar.gz")
    specs = [InputSpec("a", (1, 3), np.float32), InputSpec("b", (1, 2), np.int64)]
    cfgs = [
        DatasetConfig("b", str(archive_b), "Numpy", -1, field_path="quant.input_configs[0]"),
        DatasetConfig("a", str(tmp_path / "a"), "Binary", -1, field_path="quant.input_configs[1]"),
    ]
    return specs, cfgs


def test_multi_input_samples_match_by_name(tmp_path: Path) -> None:
    specs, cfgs = _two_inputs(tmp_path, ["3", "1", "2"], ["2", "3", "1"])
    with CalibrationData(specs, cfgs) as data:
        assert data.sample_names() == ["1", "2", "3"]
        for name, sample in zip(data.sample_names(), data, strict=True):
            assert list(sample) == ["a", "b"]
            assert sample["a"].tolist() == [[float(name)] * 3]
            assert sample["b"].tolist() == [[int(name)] * 2]


def test_multi_input_name_mismatch(tmp_path: Path) -> None:
    specs, cfgs = _two_inputs(tmp_path, ["1", "2", "4"], ["1", "2", "3"])
    with pytest.raises(PulsarError) as err:
        CalibrationData(specs, cfgs)
    msg = str(err.value)
    assert "input a" in msg and "lacks 3" in msg and "input b" in msg and "lacks 4" in msg


def test_calibration_size(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for i in range(5):
        np.save(tmp_path / f"s{i}.npy", np.full((1,), i, np.float32))
    spec = InputSpec("x", (1,), np.float32)

    def names(size: int) -> list[str]:
        with calib([spec], DatasetConfig("x", str(tmp_path), "Numpy", size)) as data:
            assert len(data) == len(list(data))
            return data.sample_names()

    assert names(3) == ["s0", "s1", "s2"]
    assert names(-1) == [f"s{i}" for i in range(5)]
    with caplog.at_level(logging.WARNING, logger="pulsar"):
        assert len(names(32)) == 5
    assert "calibration_size is 32 but only 5" in caplog.text
    with pytest.raises(PulsarError, match=r"calibration_size: 0 is not allowed"):
        names(0)

    # Several inputs: the smallest calibration_size wins.
    specs, cfgs = _two_inputs(tmp_path / "n", ["1", "2", "3"], ["1", "2", "3"])
    cfgs[1] = DatasetConfig("a", cfgs[1].calibration_dataset, "Binary", 2)
    with CalibrationData(specs, cfgs) as data:
        assert data.sample_names() == ["1", "2"]


def test_ignored_files_and_empty_dataset(tmp_path: Path) -> None:
    src = tmp_path / "d"
    (src / "__MACOSX").mkdir(parents=True)
    (src / ".cache").mkdir()
    np.save(src / "__MACOSX" / "a.npy", np.zeros(1, np.float32))
    np.save(src / ".cache" / "b.npy", np.zeros(1, np.float32))
    np.save(src / ".hidden.npy", np.zeros(1, np.float32))
    (src / "readme.md").write_text("hi")
    spec = InputSpec("x", (1,), np.float32)
    for kind in ["dir", "zip"]:
        dataset = pack(src, kind)
        cfg = DatasetConfig("x", str(dataset), "Numpy", field_path="quant.input_configs[3]")
        with pytest.raises(PulsarError) as err:
            calib([spec], cfg)
        msg = str(err.value)
        assert "quant.input_configs[3].calibration_dataset" in msg and str(dataset) in msg and ".md" in msg
    np.save(src / "real.npy", np.ones(1, np.float32))
    with calib([spec], DatasetConfig("x", str(pack(src, "tar")), "Numpy")) as data:
        assert data.sample_names() == ["real"]


def test_config_validation(tmp_path: Path) -> None:
    default = tmp_path / "default"
    default.mkdir()
    np.save(default / "a.npy", np.zeros(1, np.float32))
    specs = [InputSpec("images", (1,), np.float32), InputSpec("mask", (1,), np.float32)]
    ok = DatasetConfig("DEFAULT", str(default), "Numpy")
    with pytest.raises(
        PulsarError,
        match=r"quant\.input_configs\[1\]\.tensor_name: 'image' is not a model input.*did you mean \"images\"",
    ):
        calib(specs, ok, DatasetConfig("image", str(default), "Numpy", field_path="quant.input_configs[1]"))
    with pytest.raises(PulsarError, match="'mask' has no calibration data"):
        calib(specs, DatasetConfig("images", str(default), "Numpy"))
    with pytest.raises(PulsarError, match='did you mean "Numpy"'):
        calib(specs, DatasetConfig("DEFAULT", str(default), "numpy"))
    with pytest.raises(PulsarError, match="DEFAULT is already used"):
        calib(specs, ok, ok)
    missing = tmp_path / "nope.tar"
    with pytest.raises(
        PulsarError, match=r"quant\.input_configs\[4\]\.calibration_dataset: '.*nope\.tar' does not"
    ):
        calib(specs, DatasetConfig("DEFAULT", str(missing), "Numpy", field_path="quant.input_configs[4]"))
    rar = tmp_path / "data.rar"
    rar.write_bytes(b"x")
    with pytest.raises(
        PulsarError, match=r"calibration_dataset: '.*data\.rar' is not a directory or a supported"
    ):
        calib(specs, DatasetConfig("DEFAULT", str(rar), "Numpy"))
    (tmp_path / "fake.zip").write_bytes(b"not a zip")
    with pytest.raises(PulsarError, match="cannot open zip archive"):
        calib(specs, DatasetConfig("DEFAULT", str(tmp_path / "fake.zip"), "Numpy"))
    # Per-input entries win over DEFAULT.
    other = tmp_path / "other"
    other.mkdir()
    np.save(other / "a.npy", np.ones(1, np.float32))
    with calib(specs, ok, DatasetConfig("mask", str(other), "Numpy")) as data:
        (sample,) = list(data)
    assert sample["images"].tolist() == [0.0] and sample["mask"].tolist() == [1.0]


# -- streaming, describe, fingerprint ------------------------------------------------------------------
def test_streaming_reads_one_sample_at_a_time(tmp_path: Path) -> None:
    """Sample 150 of 200 is corrupt: the count and the first 150 samples come before anyone reads it."""
    entries = []
    for i in range(200):
        data = np.full((1, 8), i, np.float32).tobytes()
        entries.append((f"s{i:03d}.bin", data[:-4] if i == 150 else data))
    archive = tar_with(tmp_path / "big.tar", entries[::-1])  # archive order differs from sample order
    spec = InputSpec("x", (1, 8), np.float32)
    data = calib([spec], DatasetConfig("x", str(archive), "Binary", -1))
    assert len(data) == 200
    stream = iter(data)
    assert next(stream)["x"][0, 0] == 0.0
    seen = 1
    with pytest.raises(PulsarError, match=r"big\.tar:s150\.bin: input 'x' expects 32 bytes"):
        for sample in stream:
            assert sample["x"][0, 0] == seen
            seen += 1
    assert seen == 150
    # A new iteration starts over from the first sample.
    assert next(iter(data))["x"][0, 0] == 0.0
    data.close()
    with pytest.raises(RuntimeError):
        iter(data)


def test_unordered_compressed_tar_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    spec = InputSpec("x", (1,), np.float32)
    for order, warns in [(["a", "b", "c"], False), (["c", "a", "b"], True)]:
        archive = tmp_path / f"{''.join(order)}.tar.gz"
        with tarfile.open(archive, "w:gz") as tf:
            for name in order:
                info = tarfile.TarInfo(f"{name}.bin")
                info.size = 4
                tf.addfile(info, io.BytesIO(np.float32(ord(name)).tobytes()))
        caplog.clear()
        with (
            caplog.at_level(logging.WARNING, logger="pulsar"),
            calib([spec], DatasetConfig("x", str(archive), "Binary")) as data,
        ):
            assert [float(s["x"][0]) for s in data] == [97.0, 98.0, 99.0]
        assert ("not stored in sorted name order" in caplog.text) == warns


def test_describe_and_fingerprint(tmp_path: Path) -> None:
    src = tmp_path / "d"
    src.mkdir()
    for i in range(3):
        (src / f"{i}.bin").write_bytes(b"corrupt")  # never read: fingerprint and describe use metadata only
    spec = InputSpec("x", (1, 2), np.float32)
    cfg = DatasetConfig("DEFAULT", str(src), "Binary", 2)
    with calib([spec], cfg) as data:
        rows = data.describe()
        key = data.fingerprint()
    assert rows == [
        {"input": "x", "shape": [1, 2], "dataset": str(src), "format": "Binary", "tensor_format": None,
         "mean": [], "std": [], "samples": 2}
    ]  # fmt: skip
    assert len(key) == 64
    with calib([spec], cfg) as data:
        assert data.fingerprint() == key
    with calib([spec], DatasetConfig("DEFAULT", str(src), "Binary", 3)) as data:
        assert data.fingerprint() != key
    (src / "1.bin").write_bytes(b"changed!")
    with calib([spec], cfg) as data:
        assert data.fingerprint() != key
    archive = pack(src, "zip")
    with calib([spec], DatasetConfig("DEFAULT", str(archive), "Binary", 2)) as data:
        zkey = data.fingerprint()
    with zipfile.ZipFile(archive, "w") as zf:  # same names and sizes, other contents: CRC differs
        for i in range(3):
            zf.writestr(f"{i}.bin", b"CHANGED!" if i == 0 else (b"corrupt" if i == 2 else b"changed!"))
    with calib([spec], DatasetConfig("DEFAULT", str(archive), "Binary", 2)) as data:
        assert data.fingerprint() != zkey


def test_image_describe_row(tmp_path: Path) -> None:
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(tmp_path / "a.bmp")
    spec = InputSpec("img", (1, 4, 4, 3), np.float32, "RGB", "NHWC")
    cfg = DatasetConfig("img", str(tmp_path), "Image", 8, [1, 2, 3], [4, 5, 6])
    with calib([spec], cfg) as data:
        (row,) = data.describe()
        (sample,) = list(data)
    assert row["tensor_format"] == "RGB" and row["mean"] == [1.0, 2.0, 3.0] and row["std"] == [4.0, 5.0, 6.0]
    np.testing.assert_allclose(sample["img"][0, 0, 0], [-1 / 4, -2 / 5, -3 / 6])
