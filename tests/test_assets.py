"""The example / benchmark assets are real: the models load and predict correctly on the data we make."""

from __future__ import annotations

import tarfile

import numpy as np
import onnx
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("rapidocr_onnxruntime")
pytest.importorskip("skimage")

from examples import assets  # noqa: E402
from examples.mobilenet_v2 import mobilenet_v2_pretrained  # noqa: E402


def _session(path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="session")
def mbv2_onnx(tmp_path_factory):
    return assets.mobilenet_v2_onnx(tmp_path_factory.mktemp("mbv2") / "mobilenetv2.onnx")


def test_mobilenet_onnx_matches_torch(mbv2_onnx):
    model = onnx.load(str(mbv2_onnx))
    assert model.opset_import[0].version == 17
    assert [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim] == [1, 3, 224, 224]
    x = np.stack([assets.imagenet_preprocess(c)[0] for c in assets.photo_crops(2, seed=5)])
    with torch.no_grad():
        expected = mobilenet_v2_pretrained()(torch.from_numpy(x)).numpy()
    sess = _session(mbv2_onnx)
    got = np.concatenate([sess.run(["output"], {"input": x[i : i + 1]})[0] for i in range(2)])
    np.testing.assert_allclose(got, expected, atol=1e-3, rtol=1e-3)


def test_mobilenet_export_is_cached(mbv2_onnx):
    before = mbv2_onnx.stat().st_mtime_ns
    assert assets.mobilenet_v2_onnx(mbv2_onnx) == mbv2_onnx
    assert mbv2_onnx.stat().st_mtime_ns == before


def test_mobilenet_cache_rejects_broken_or_foreign_files(tmp_path, mbv2_onnx):
    """A truncated file or another model at the path is re-exported, not trusted."""
    assert assets._valid_mobilenet_onnx(mbv2_onnx)
    bad = tmp_path / "m.onnx"
    bad.write_bytes(mbv2_onnx.read_bytes()[:1000])
    assert not assets._valid_mobilenet_onnx(bad)
    x = onnx.helper.make_tensor_value_info("input", onnx.TensorProto.FLOAT, [1, 3, 8, 8])
    y = onnx.helper.make_tensor_value_info("output", onnx.TensorProto.FLOAT, [1, 3, 8, 8])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Relu", ["input"], ["output"])], "g", [x], [y])
    onnx.save(onnx.helper.make_model(graph), str(bad))
    assert not assets._valid_mobilenet_onnx(bad)


def test_chelsea_is_a_cat(mbv2_onnx):
    logits = _session(mbv2_onnx).run(
        None, {"input": assets.imagenet_preprocess(assets.load_photo("chelsea"))}
    )[0]
    assert int(logits.argmax()) in assets.IMAGENET_CAT_CLASSES


def test_imagenet_preprocess_shape_and_normalization():
    img = np.full((300, 451, 3), (123, 116, 104), dtype=np.uint8)
    x = assets.imagenet_preprocess(img)
    assert x.shape == (1, 3, 224, 224) and x.dtype == np.float32
    assert np.abs(x).max() < 0.02


def test_charset_follows_ctc_convention():
    charset = assets.ppocr_charset(assets.ppocr_rec_model())
    assert len(charset) == 6625
    assert charset[-1] == " " and charset[0] not in charset[1:]
    assert all(c in charset for c in "abcXYZ0189-.")


def test_ctc_decode_collapses_repeats_and_drops_blank():
    charset = ["<blank>", "a", "b", " "]
    steps = [1, 1, 0, 1, 2, 2, 3, 0, 0]
    probs = np.eye(4, dtype=np.float32)[steps][None]
    assert assets.ctc_decode(probs, charset) == "aab "


def test_float_recognizer_reads_rendered_lines():
    model = assets.ppocr_rec_model()
    charset = assets.ppocr_charset(model)
    sess = _session(model)
    lines = assets.render_text_lines(30, seed=123, part="eval")
    assert all(img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3 for img, _ in lines)
    reads = [
        assets.ctc_decode(sess.run(None, {"x": assets.ocr_preprocess(img)})[0], charset) for img, _ in lines
    ]
    exact = sum(assets.normalize_text(r) == text for r, (_, text) in zip(reads, lines, strict=True))
    assert exact / len(lines) >= 0.9


def test_ocr_preprocess_pads_to_fixed_width():
    img = np.full((24, 40, 3), 255, dtype=np.uint8)
    x = assets.ocr_preprocess(img)
    assert x.shape == (1, 3, 48, 320) and x.dtype == np.float32
    assert np.allclose(x[..., :80], 1.0) and np.all(x[..., 80:] == 0)


def test_sets_are_deterministic_and_disjoint():
    a = assets.render_text_lines(20, seed=7, part="calib")
    b = assets.render_text_lines(20, seed=7, part="calib")
    assert [t for _, t in a] == [t for _, t in b] and all(
        np.array_equal(x, y) for (x, _), (y, _) in zip(a, b, strict=True)
    )
    evals = {t for _, t in assets.render_text_lines(200, seed=7, part="eval")}
    assert not evals & {t for _, t in assets.render_text_lines(200, seed=7, part="calib")}
    crops = assets.photo_crops(3, seed=1, size=64, part="calib")
    assert all(c.shape == (64, 64, 3) and c.dtype == np.uint8 for c in crops)
    assert all(
        np.array_equal(c, d)
        for c, d in zip(crops, assets.photo_crops(3, seed=1, size=64, part="calib"), strict=True)
    )
    assert not np.array_equal(crops[0], assets.photo_crops(1, seed=1, size=64, part="eval")[0])


def test_make_example_assets(tmp_path, mbv2_onnx):
    (tmp_path / "mobilenetv2.onnx").write_bytes(mbv2_onnx.read_bytes())  # reuse the session's export
    (tmp_path / "imagenet_calib").mkdir()
    (tmp_path / "imagenet_calib" / "calib_0099.jpg").write_bytes(b"stale")
    paths = assets.make_example_assets(tmp_path, n_calib=4)
    assert set(paths) == {"mobilenetv2", "imagenet_calib", "imagenet_calib_tar", "ocr_rec", "ocr_calib"}
    jpgs = sorted(paths["imagenet_calib"].glob("*.jpg"))
    assert len(jpgs) == 4
    from PIL import Image

    assert all(Image.open(j).size == (224, 224) and Image.open(j).mode == "RGB" for j in jpgs)
    with tarfile.open(paths["imagenet_calib_tar"]) as tar:
        assert sorted(tar.getnames()) == [j.name for j in jpgs]
    npys = sorted(paths["ocr_calib"].glob("*.npy"))
    assert len(npys) == 4
    arr = np.load(npys[0], allow_pickle=False)
    assert arr.shape == (1, 3, 48, 320) and arr.dtype == np.float32
    assert paths["ocr_rec"].read_bytes() == assets.ppocr_rec_model().read_bytes()


def test_bench_quant_smoke(tmp_path, capsys, mbv2_onnx):
    """The accuracy benchmark runs end to end on a tiny evaluation set (one method each side)."""
    from bench import bench_quant

    (tmp_path / "assets").mkdir()
    (tmp_path / "assets" / "mobilenetv2.onnx").write_bytes(mbv2_onnx.read_bytes())
    out_json = tmp_path / "figures.json"
    argv = [
        "--models",
        "mbv2",
        "--eval-n",
        "4",
        "--n-calib",
        "4",
        "--pulsar-methods",
        "MinMax",
        "--ort-methods",
        "MinMax",
    ]
    assert (
        bench_quant.main([*argv, "--check-n", "1", "--work-dir", str(tmp_path), "--json", str(out_json)]) == 0
    )
    table = capsys.readouterr().out
    assert "MobileNetV2" in table and "ORT MinMax" in table
    import json

    rows = {r["method"]: r for r in json.loads(out_json.read_text())["mbv2"]}
    assert rows["float"]["scores"]["top1_agree@float"] == 1.0
    assert 0.0 <= rows["ORT MinMax"]["scores"]["top1_agree@int"] <= 1.0
    if bench_quant._pulsar_build() is not None:
        pulsar_row = rows["pulsar MinMax"]
        assert not pulsar_row["note"], pulsar_row["note"]
        assert pulsar_row["session_diff"][0] < 1e-4  # Session reproduces the QDQ model run as float math
