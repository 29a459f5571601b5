"""Input / output processors on real photos, run in onnxruntime, against independent numpy / PIL references.

The YUV references do not share code with pulsar: limited range uses the textbook BT.601 studio-swing
formulas written out below, full range uses PIL's JPEG YCbCr conversion in both directions. Chroma is
subsampled the way encoders do (block average), and the expected RGB is computed from the SAME
subsampled chroma, so the tolerance measures the conversion, not the subsampling.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from PIL import Image
from skimage import data

from pulsar.config.model import to_typed
from pulsar.config.schema import fill_defaults
from pulsar.config.validate import validate
from pulsar.errors import PulsarError
from pulsar.frontend.processors import attach_input_processors, attach_output_processors
from tests.tiny_model import make_tiny_cnn

MEAN = [123.675, 116.28, 103.53]
STD = [58.395, 57.12, 57.375]


# ---- helpers ------------------------------------------------------------------------------------


def procs(section: str, *entries: dict[str, Any]) -> tuple[Any, ...]:
    """Processors exactly as a build gets them: schema defaults filled, validated, typed."""
    cfg = fill_defaults({section: list(entries)})
    validate(cfg)
    return getattr(to_typed(cfg), section)


def identity_model(dims: list, elem_type: int = TensorProto.FLOAT) -> onnx.ModelProto:
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "identity",
                              [helper.make_tensor_value_info("x", elem_type, dims)],
                              [helper.make_tensor_value_info("y", elem_type, dims)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def run(model: onnx.ModelProto, **feeds: np.ndarray) -> list[np.ndarray]:
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def preprocess(dims: list, *entries: dict[str, Any], calibration=None, elem_type=TensorProto.FLOAT, **feed):
    model, lines = attach_input_processors(identity_model(dims, elem_type), procs("input_processors", *entries),
                                           calibration or {})
    (out,) = run(model, **feed)
    return out, model, lines


def limited_forward(rgb: np.ndarray) -> np.ndarray:
    """BT.601 studio swing (textbook coefficients on R'G'B' in 0..1), rounded to uint8 YCbCr."""
    r, g, b = np.moveaxis(rgb.astype(np.float64) / 255.0, -1, 0)
    y = 16 + 65.481 * r + 128.553 * g + 24.966 * b
    cb = 128 - 37.797 * r - 74.203 * g + 112.0 * b
    cr = 128 + 112.0 * r - 93.786 * g - 18.214 * b
    return np.clip(np.round(np.stack([y, cb, cr], -1)), 0, 255).astype(np.uint8)


def limited_inverse(ycc: np.ndarray) -> np.ndarray:
    y, cb, cr = np.moveaxis(ycc.astype(np.float64), -1, 0)
    r = 1.164 * (y - 16) + 1.596 * (cr - 128)
    g = 1.164 * (y - 16) - 0.392 * (cb - 128) - 0.813 * (cr - 128)
    b = 1.164 * (y - 16) + 2.017 * (cb - 128)
    return np.clip(np.stack([r, g, b], -1), 0, 255)


def full_forward(rgb: np.ndarray) -> np.ndarray:
    return np.asarray(Image.fromarray(rgb).convert("YCbCr"))


def full_inverse(ycc: np.ndarray) -> np.ndarray:
    return np.asarray(Image.fromarray(ycc, "YCbCr").convert("RGB")).astype(np.float64)


CONVERSIONS = {"LimitedRange": (limited_forward, limited_inverse), "FullRange": (full_forward, full_inverse)}


def subsample(plane: np.ndarray, rows: int) -> np.ndarray:
    """Average blocks of ``rows`` x 2 samples (4:2:0: rows=2, 4:2:2: rows=1), as encoders do."""
    h, w = plane.shape
    blocks = plane.astype(np.float64).reshape(h // rows, rows, w // 2, 2).mean(axis=(1, 3))
    return np.round(blocks).astype(np.uint8)


def upsample(plane: np.ndarray, rows: int) -> np.ndarray:
    return plane.repeat(rows, axis=0).repeat(2, axis=1)


def yuv_case(photo: np.ndarray, mode: str, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Y, subsampled U, V and the reference RGB decoded from exactly those samples."""
    forward, inverse = CONVERSIONS[mode]
    ycc = forward(photo)
    u, v = subsample(ycc[..., 1], rows), subsample(ycc[..., 2], rows)
    reference = inverse(np.stack([ycc[..., 0], upsample(u, rows), upsample(v, rows)], -1))
    return ycc[..., 0], u, v, reference


def pack_semi_planar(y: np.ndarray, u: np.ndarray, v: np.ndarray, vu: bool) -> np.ndarray:
    h, w = y.shape
    pairs = np.stack([v, u] if vu else [u, v], -1).reshape(h // 2, w)
    return np.concatenate([y, pairs])[None, :, :, None]  # N x (H*3/2) x W x 1


def pack_422(y: np.ndarray, u: np.ndarray, v: np.ndarray, uyvy: bool) -> np.ndarray:
    h, w = y.shape
    chroma = np.stack([u, v], -1).reshape(h, w)  # U on even columns, V on odd
    return np.stack([chroma, y] if uyvy else [y, chroma], -1)[None]  # N x H x W x 2


def nchw(hwc: np.ndarray) -> np.ndarray:
    return hwc.transpose(2, 0, 1)[None]


# ---- input processors ---------------------------------------------------------------------------


def test_bgr_u8_nhwc_to_rgb_nchw_with_mean_std() -> None:
    rgb = data.astronaut()
    h, w, _ = rgb.shape
    out, model, lines = preprocess(
        [1, 3, h, w],
        {"tensor_name": "x", "tensor_format": "RGB", "src_format": "BGR", "src_layout": "NHWC",
         "src_dtype": "U8", "mean": MEAN, "std": STD},
        x=rgb[None, ..., ::-1].copy(),
    )
    expected = nchw((rgb.astype(np.float64) - MEAN) / STD)
    np.testing.assert_allclose(out, expected, atol=1e-4)
    graph_input = model.graph.input[0]
    assert graph_input.name == "x" and graph_input.type.tensor_type.elem_type == TensorProto.UINT8
    assert [d.dim_value for d in graph_input.type.tensor_type.shape.dim] == [1, h, w, 3]
    assert model.graph.node[-1].input == ["x_preprocessed"]
    assert "BGR->RGB" in lines[0] and "NHWC->NCHW" in lines[0]


def test_mean_std_default_to_calibration() -> None:
    rgb = data.coffee()[:64, :96]
    calibration = {"x": (MEAN, STD)}
    entry = {"tensor_name": "DEFAULT", "src_layout": "NHWC", "src_dtype": "U8"}
    out, _, _ = preprocess([1, 3, 64, 96], entry, calibration=calibration, x=rgb[None])
    np.testing.assert_allclose(out, nchw((rgb - np.array(MEAN)) / STD), atol=1e-4)
    out, _, _ = preprocess([1, 3, 64, 96], {**entry, "mean": [], "std": [2, 2, 2]}, calibration=calibration,
                           x=rgb[None])
    np.testing.assert_allclose(out, nchw(rgb / 2.0), atol=1e-5)


@pytest.mark.parametrize("photo", ["astronaut", "coffee"])
@pytest.mark.parametrize("mode", ["FullRange", "LimitedRange"])
@pytest.mark.parametrize("src_format", ["YUV420SP", "YVU420SP"])
def test_semi_planar_to_rgb(photo: str, mode: str, src_format: str) -> None:
    rgb = getattr(data, photo)()
    h, w, _ = rgb.shape
    y, u, v, reference = yuv_case(rgb, mode, rows=2)
    frame = pack_semi_planar(y, u, v, vu=src_format == "YVU420SP")
    out, model, _ = preprocess(
        [1, 3, h, w],
        {"tensor_name": "x", "tensor_format": "RGB", "src_format": src_format, "src_layout": "NHWC",
         "src_dtype": "U8", "csc_mode": mode},
        x=frame,
    )
    assert [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim] == [1, h * 3 // 2, w, 1]
    assert np.abs(out - nchw(reference)).max() <= 1.0
    assert np.abs(out - nchw(rgb.astype(np.float64))).mean() < 3.0  # and it is the photo


@pytest.mark.parametrize("mode", ["FullRange", "LimitedRange"])
@pytest.mark.parametrize("src_format", ["YUYV422", "UYVY422"])
def test_packed_422_to_bgr(mode: str, src_format: str) -> None:
    rgb = data.coffee()
    h, w, _ = rgb.shape
    y, u, v, reference = yuv_case(rgb, mode, rows=1)
    frame = pack_422(y, u, v, uyvy=src_format == "UYVY422")
    out, _, lines = preprocess(
        [1, h, w, 3],
        {"tensor_name": "x", "tensor_format": "BGR", "tensor_layout": "NHWC", "src_format": src_format,
         "src_dtype": "U8", "csc_mode": mode},
        x=frame,
    )
    assert np.abs(out[0] - reference[..., ::-1]).max() <= 1.0
    assert "UYVY" in lines[0] or "YUYV" in lines[0]


def test_nchw_deployed_yuv_and_csc_matrix_layout() -> None:
    """csc_mat as documented (rows R, G, B; columns Y, U, V, bias) reproduces the textbook inverse."""
    rgb = data.astronaut()[100:300, 50:350]
    h, w, _ = rgb.shape
    y, u, v, _ = yuv_case(rgb, "LimitedRange", rows=2)
    frame = pack_semi_planar(y, u, v, vu=False).transpose(0, 3, 1, 2)  # N x 1 x (H*3/2) x W
    textbook = np.array([[1.164, 0.0, 1.596], [1.164, -0.392, -0.813], [1.164, 2.017, 0.0]])
    csc_mat = np.hstack([textbook, -(textbook @ [16, 128, 128])[:, None]]).ravel().tolist()
    out, _, _ = preprocess(
        [1, 3, h, w],
        {"tensor_name": "x", "tensor_format": "RGB", "src_format": "YUV420SP", "src_layout": "NCHW",
         "src_dtype": "U8", "csc_mode": "Matrix", "csc_mat": csc_mat},
        x=frame,
    )
    full = np.stack([y, upsample(u, 2), upsample(v, 2)], -1).astype(np.float64)
    unclipped = (full - [16, 128, 128]) @ textbook.T  # Matrix mode is not clipped
    np.testing.assert_allclose(out, nchw(unclipped), atol=1e-3)


@pytest.mark.parametrize("src_format", ["RGB", "BGR"])
def test_color_to_gray(src_format: str) -> None:
    rgb = data.chelsea()
    h, w, _ = rgb.shape
    frame = rgb if src_format == "RGB" else rgb[..., ::-1]
    out, _, lines = preprocess([1, 1, h, w], {"tensor_name": "x", "src_format": src_format, "src_layout": "NHWC",
                                              "src_dtype": "U8"}, x=np.ascontiguousarray(frame[None]))
    luma = rgb.astype(np.float64) @ [0.299, 0.587, 0.114]
    np.testing.assert_allclose(out[0, 0], luma, atol=1e-3)
    pil = np.asarray(Image.fromarray(rgb).convert("L"), dtype=np.float64)  # rounded by PIL
    assert np.abs(out[0, 0] - pil).max() <= 0.51
    assert "GRAY" in lines[0]


def test_gray_to_rgb_replicates() -> None:
    gray = np.asarray(Image.fromarray(data.coffee()).convert("L"))
    out, _, _ = preprocess([1, 3, 400, 600], {"tensor_name": "x", "tensor_format": "RGB", "src_format": "GRAY",
                                              "src_dtype": "U8"}, x=gray[None, None])
    np.testing.assert_array_equal(out[0], np.broadcast_to(gray, (3, 400, 600)))


@pytest.mark.parametrize("padding,sides", [([4, 6, 8, 2], [4, 6, 8, 2]), ([3, 5], [3, 5, 3, 5])])
def test_padding_in_pixel_units_before_mean_std(padding: list[int], sides: list[int]) -> None:
    rgb = data.chelsea()
    top, left, bottom, right = sides
    h, w = rgb.shape[0] + top + bottom, rgb.shape[1] + left + right
    out, model, lines = preprocess(
        [1, 3, h, w],
        {"tensor_name": "x", "tensor_format": "RGB", "src_format": "BGR", "src_layout": "NHWC", "src_dtype": "U8",
         "padding": padding, "padding_constant_value": 114, "mean": MEAN, "std": STD},
        x=np.ascontiguousarray(rgb[None, ..., ::-1]),
    )
    padded = np.pad(rgb.astype(np.float64), ((top, bottom), (left, right), (0, 0)), constant_values=114)
    np.testing.assert_allclose(out, nchw((padded - MEAN) / STD), atol=1e-4)
    assert [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim] == [1, *rgb.shape]
    assert "pad" in lines[0]


def test_slicing_crops_the_deployed_image_nchw_to_nhwc() -> None:
    rgb = data.coffee()  # 400 x 600
    out, model, _ = preprocess(
        [1, 360, 540, 3],
        {"tensor_name": "x", "tensor_format": "RGB", "tensor_layout": "NHWC", "src_layout": "NCHW",
         "src_dtype": "U8", "slicing": [10, 20, 30, 40]},
        x=nchw(rgb).copy(),
    )
    np.testing.assert_array_equal(out[0], rgb[10:370, 20:560])
    assert [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim] == [1, 3, 400, 600]


def test_integer_model_input_stays_integer() -> None:
    rgb = data.astronaut()[:32, :48]
    out, model, _ = preprocess([1, 3, 32, 48], {"tensor_name": "x", "tensor_format": "RGB", "src_format": "BGR",
                                                "src_layout": "NHWC"},
                               elem_type=TensorProto.UINT8, x=np.ascontiguousarray(rgb[None, ..., ::-1]))
    assert out.dtype == np.uint8
    np.testing.assert_array_equal(out, nchw(rgb))
    assert "Cast" not in {n.op_type for n in model.graph.node}


def test_processor_with_nothing_to_do_adds_nothing() -> None:
    model = identity_model([1, 3, 8, 8])
    result, lines = attach_input_processors(model, procs("input_processors", {"tensor_name": "DEFAULT"}), {})
    assert result.SerializeToString() == model.SerializeToString()
    assert "nothing to do" in lines[0]
    result, _ = attach_output_processors(model, procs("output_processors", {"tensor_name": "y"}))
    assert result.SerializeToString() == model.SerializeToString()


def _tiny_models(tmp_path: Path, dynamic: bool) -> tuple[onnx.ModelProto, np.ndarray]:
    model = onnx.load(make_tiny_cnn(tmp_path / "tiny.onnx", dynamic_batch=dynamic))
    photos = [data.astronaut(), data.coffee()]
    frames = [np.asarray(Image.fromarray(p).resize((18, 20), Image.Resampling.BILINEAR)) for p in photos]
    return model, np.stack(frames[: 2 if dynamic else 1])


def _decode_nv_numpy(frames: np.ndarray, vu: bool) -> np.ndarray:
    """Independent NV12 / NV21 decode: full-range BT.601 written out, chroma repeated over 2x2 blocks."""
    n, h, w, _ = frames.shape
    out = []
    for rgb in frames:
        ycc = full_forward(rgb)
        u, v = subsample(ycc[..., 1], 2), subsample(ycc[..., 2], 2)
        yy, uu, vv = ycc[..., 0].astype(np.float64), upsample(u, 2) - 128.0, upsample(v, 2) - 128.0
        decoded = np.stack([yy + 1.402 * vv, yy - 0.344136 * uu - 0.714136 * vv, yy + 1.772 * uu], -1)
        out.append((pack_semi_planar(ycc[..., 0], u, v, vu)[0], np.clip(decoded, 0, 255)))
    return np.stack([o[0] for o in out]), np.stack([o[1] for o in out])


@pytest.mark.parametrize("src_format,dynamic", [("YUV420SP", False), ("YVU420SP", True)])
def test_processed_tiny_cnn_equals_original_on_manual_preprocessing(tmp_path: Path, src_format: str,
                                                                    dynamic: bool) -> None:
    model, frames = _tiny_models(tmp_path, dynamic)
    raw, decoded = _decode_nv_numpy(frames, vu=src_format == "YVU420SP")
    entry = {"tensor_name": "image", "tensor_format": "RGB", "src_format": src_format, "src_layout": "NHWC",
             "src_dtype": "U8", "csc_mode": "FullRange", "slicing": [2, 1, 2, 1]}
    processed, lines = attach_input_processors(model, procs("input_processors", entry), {"image": (MEAN, STD)})
    assert model.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT  # the argument is untouched
    (got,) = run(processed, image=raw)
    manual = ((decoded[:, 2:18, 1:17] - MEAN) / STD).transpose(0, 3, 1, 2).astype(np.float32)
    (want,) = run(model, image=manual)
    np.testing.assert_allclose(got, want, atol=1e-3)
    assert got.shape[0] == len(frames) and "crop" in lines[0]


# ---- output processors --------------------------------------------------------------------------


def _two_output_model() -> onnx.ModelProto:
    """y = Identity(x) is an output and also feeds z = Relu(y)."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"]), helper.make_node("Relu", ["y"], ["z"])], "two",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 3, 4]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 2, 3, 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_output_nhwc_u8_saturating_and_dst_perm() -> None:
    x = (np.linspace(-300, 300, 24).reshape(1, 2, 3, 4)).astype(np.float32)
    x.flat[:4] = [2.5, 3.5, -0.5, 255.4]
    model, lines = attach_output_processors(_two_output_model(), procs(
        "output_processors",
        {"tensor_name": "y", "tensor_layout": "NHWC", "output_dtype": "U8"},
        {"tensor_name": "z", "dst_perm": [0, 2, 1, 3]},
    ))
    y, z = run(model, x=x)
    assert [o.name for o in model.graph.output] == ["y", "z"]
    assert y.dtype == np.uint8 and y.shape == (1, 3, 4, 2)
    np.testing.assert_array_equal(y, np.clip(np.round(x.transpose(0, 2, 3, 1)), 0, 255).astype(np.uint8))
    np.testing.assert_array_equal(y[0, 0, :4, 0], [2, 4, 0, 255])  # half to even, saturated
    np.testing.assert_allclose(z, np.maximum(x, 0).transpose(0, 2, 1, 3))  # Relu read the raw float y
    assert len(lines) == 2


@pytest.mark.parametrize("dtype,np_dtype", [("S8", np.int8), ("U16", np.uint16), ("S16", np.int16)])
def test_output_integer_dtypes_saturate(dtype: str, np_dtype: type) -> None:
    x = np.array([-1e6, -129.5, -3.5, 0.4, 127.5, 40000.0, 1e6], np.float32).reshape(1, 7)
    model, _ = attach_output_processors(identity_model([1, 7]),
                                        procs("output_processors", {"tensor_name": "DEFAULT", "output_dtype": dtype}))
    (y,) = run(model, x=x)
    info = np.iinfo(np_dtype)
    assert y.dtype == np_dtype
    np.testing.assert_array_equal(y, np.clip(np.round(x), info.min, info.max).astype(np_dtype))


# ---- errors -------------------------------------------------------------------------------------

INPUT_ERRORS = [
    ([1, 1, 4, 4], [{"tensor_name": "x", "src_format": "YUV420SP", "csc_mode": "FullRange"}], {},
     "input_processors[0].src_format"),
    ([1, 3, 4, 4], [{"tensor_name": "x", "tensor_format": "RGB", "src_format": "YUV420SP", "csc_mode": "Matrix"}],
     {}, "input_processors[0].csc_mat"),
    ([1, 3, 4, 4], [{"tensor_name": "x", "tensor_format": "RGB", "src_format": "YUV420SP"}], {},
     "input_processors[0].csc_mode"),
    ([1, 3, 4, 4], [{"tensor_name": "x", "csc_mode": "FullRange"}], {}, "input_processors[0].csc_mode"),
    ([1, 3, 4, 4], [{"tensor_name": "DEFAULT"}, {"tensor_name": "x", "mean": [1, 2]}], {},
     "input_processors[1].mean"),
    ([1, 3, 4, 4], [{"tensor_name": "x"}], {"x": ([0, 0, 0], [1, 0, 1])}, "input_processors[0].std"),
    ([1, 10], [{"tensor_name": "x", "src_layout": "NHWC"}], {}, "input_processors[0].src_layout"),
    ([1, 10], [{"tensor_name": "x", "padding": [1, 1]}], {}, "input_processors[0].padding"),
    ([1, 3, 4, 5], [{"tensor_name": "x", "tensor_format": "RGB", "src_format": "YUV420SP", "csc_mode": "FullRange"}],
     {}, "input_processors[0].src_format"),
    ([1, 3, 5, 4], [{"tensor_name": "x", "tensor_format": "RGB", "src_format": "YVU420SP", "csc_mode": "FullRange"}],
     {}, "input_processors[0].src_format"),
    ([1, 3, 4, 4], [{"tensor_name": "x", "padding": [2, 0, 2, 0]}], {}, "input_processors[0].padding"),
    ([1, 3, 4, 4], [{"tensor_name": "x", "slicing": [1, 2, 3]}], {}, "input_processors[0].slicing"),
    ([1, 4, 4, 4], [{"tensor_name": "x", "tensor_format": "RGB"}], {}, "input_processors[0].tensor_format"),
    ([1, 3, 4, 4], [{"tensor_name": "xx"}], {}, 'input_processors[0].tensor_name: the model has no input "xx" '
     '(did you mean "x"?)'),
]


@pytest.mark.parametrize("dims,entries,calibration,expected", INPUT_ERRORS)
def test_input_errors_name_the_field(dims: list, entries: list, calibration: dict, expected: str) -> None:
    with pytest.raises(PulsarError) as err:
        attach_input_processors(identity_model(dims), procs("input_processors", *entries), calibration)
    assert str(err.value).startswith(expected), str(err.value)


def test_yuv422_allows_odd_height() -> None:
    model, _ = attach_input_processors(identity_model([1, 3, 5, 4]), procs("input_processors", {
        "tensor_name": "x", "tensor_format": "RGB", "src_format": "YUYV422", "csc_mode": "FullRange",
        "src_dtype": "U8", "src_layout": "NHWC"}), {})
    (out,) = run(model, x=np.full((1, 5, 4, 2), 128, np.uint8))
    np.testing.assert_allclose(out, 128.0, atol=1e-3)


@pytest.mark.parametrize("entry,expected", [
    ({"tensor_name": "y", "dst_perm": [0, 1, 1, 2]}, "output_processors[0].dst_perm"),
    ({"tensor_name": "y", "dst_perm": [0, 2, 3, 1], "tensor_layout": "NHWC"}, "output_processors[0].dst_perm"),
    ({"tensor_name": "z", "output_dtype": "U8"}, 'output_processors[0].tensor_name: the model has no output "z"'),
])
def test_output_errors_name_the_field(entry: dict, expected: str) -> None:
    with pytest.raises(PulsarError) as err:
        attach_output_processors(identity_model([1, 3, 4, 4]), procs("output_processors", entry))
    assert str(err.value).startswith(expected), str(err.value)


def test_output_nhwc_needs_rank_4() -> None:
    with pytest.raises(PulsarError, match=r"output_processors\[0\]\.tensor_layout"):
        attach_output_processors(identity_model([1, 10]),
                                 procs("output_processors", {"tensor_name": "y", "tensor_layout": "NHWC"}))
