"""Multi-batch and extra shapes on the real models (slow): the PP-OCRv4 recognizer (its Reshapes bake
the batch) and MobileNetV2 with an extra 256x256 input shape. bench/bench_variants.py prints more."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import pulsar
from examples.assets import IMAGENET_MEAN, IMAGENET_STD, OBJECT_PHOTOS, make_example_assets, photo_crops
from pulsar.errors import PulsarError

pytestmark = pytest.mark.slow
N = 9


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_example_assets(tmp_path_factory.mktemp("assets"), n_calib=16)


def _ocr(assets, out, **compiler):
    overrides = {"compiler.check": 0,
                 "quant.input_configs": [{"tensor_name": "x", "calibration_dataset": str(assets["ocr_calib"]),
                                          "calibration_format": "Numpy", "calibration_size": 16}],
                 **{f"compiler.{k}": v for k, v in compiler.items()}}
    return pulsar.build(assets["ocr_rec"], out, "configs/ocr_rec.yaml", overrides, quiet=True).compiled_model


def _equal_to_singles(path, sizes=(3, N)):
    sess = pulsar.Session(path)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, *sess.inputs[0].shape[1:])).astype(sess.inputs[0].dtype)
    name = sess.inputs[0].name
    singles = [sess.run({name: x[i:i + 1]}) for i in range(N)]
    for n in sizes:
        got = sess.run_batches({name: x[:n]}, n)
        for key, value in got.items():
            np.testing.assert_array_equal(value, np.concatenate([s[key] for s in singles[:n]]))
    return sess


def _log_lines(path, prefix):
    return [line.split(prefix, 1)[1] for line in (path.parent / "build.log").read_text().splitlines() if prefix in line]


def test_ocr_static_batches_fix_the_reshapes_and_stay_bit_exact(assets, tmp_path):
    single = _ocr(assets, tmp_path / "single")
    multi = _ocr(assets, tmp_path / "multi", static_batch_sizes=[1, 2, 4])
    fixes = _log_lines(multi, "multi-batch IR fix: ")
    assert "Reshape 'p2o.Reshape.64': shape [1, 120, -1] -> [0, 120, -1]" in fixes, fixes
    sess = _equal_to_singles(multi)
    assert sess.batch_plan(9).startswith("npu_0: 4 + 4 + 1")
    ratio = multi.stat().st_size / single.stat().st_size
    print(f"\nPP-OCRv4 recognizer, static [1, 2, 4]: {ratio:.3f}x the batch-1 file")
    assert ratio <= 1.1
    with pytest.raises(PulsarError, match=r"Reshape 'p2o.Reshape.64' has batch 1 baked into a constant"):
        _ocr(assets, tmp_path / "unfixed", static_batch_sizes=[1, 2, 4], disable_ir_fix=True)


def test_ocr_dynamic_batches_are_logged_and_bit_exact(assets, tmp_path):
    path = _ocr(assets, tmp_path / "dyn", max_dynamic_batch_size=8)
    lines = _log_lines(path, "dynamic batch: ")
    assert len(lines) == len([sg for sg in pulsar.Session(path).compiled.subgraphs if sg.kind == "npu"])
    assert all("stopped:" in line and "ms/sample" in line for line in lines)
    print("\n" + "\n".join(lines))
    _equal_to_singles(path, sizes=(N,))


def test_mobilenet_extra_shape_keeps_its_accuracy(assets, tmp_path):
    res = pulsar.build(assets["mobilenetv2"], tmp_path / "out", "configs/mobilenetv2.toml", {
        "compiler.check": 0,
        "input_processors": [{"tensor_name": "DEFAULT", "tensor_format": "RGB", "tensor_layout": "NCHW",
                              "src_format": "RGB", "src_layout": "NHWC", "src_dtype": "U8",
                              "src_extra_shapes": [{"shape": [1, 3, 256, 256]}, {"shape": [1, 3, 192, 160]}]}],
        "quant.input_configs": [{"tensor_name": "DEFAULT", "calibration_dataset": str(assets["imagenet_calib_tar"]),
                                 "calibration_format": "Image", "calibration_mean": [123.675, 116.28, 103.53],
                                 "calibration_std": [58.395, 57.12, 57.375]}]}, quiet=True)
    float_model = onnx.load(str(assets["mobilenetv2"]))
    agreement = {}
    for group, size in ((0, 224), (1, 256)):
        float_model.graph.input[0].type.tensor_type.shape.dim[2].dim_value = size
        float_model.graph.input[0].type.tensor_type.shape.dim[3].dim_value = size
        float_sess = ort.InferenceSession(float_model.SerializeToString())
        sess = pulsar.Session(res.compiled_model, group=group)
        assert sess.inputs[0].shape == (1, size, size, 3)
        crops = photo_crops(60, seed=99, size=size, part="eval", photos=OBJECT_PHOTOS)
        agree = []
        for c in crops:
            x = (c.astype(np.float32) - np.float32(IMAGENET_MEAN)) / np.float32(IMAGENET_STD)
            want = float_sess.run(None, {"input": np.ascontiguousarray(x.transpose(2, 0, 1)[None])})[0]
            agree.append(want.argmax() == sess.run({"input": c[None]})["output"].argmax())
        agreement[size] = float(np.mean(agree))
    print(f"\nMobileNetV2 top-1 agreement with float at the same size: {agreement}")
    assert agreement[256] >= agreement[224] - 0.02 - 1 / 60  # within 2 points (one crop of slack at n = 60)
