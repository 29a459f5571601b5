"""Colour handling for input processors: RGB / BGR / GRAY conversions, YUV unpacking, CSC matrices.

Everything here is built from standard ONNX ops so the preprocessing runs (and is compiled) with the
model: channel reverse is a Gather, per-pixel colour maps are a 1x1 Conv (NCHW) or a MatMul + Add
(NHWC), YUV unpacking is Slice / Reshape / nearest Resize / Concat.

CSC matrix (``csc_mat``, also how FullRange / LimitedRange are expressed): 12 numbers, a row-major
3x4 matrix. Row r computes output channel r of (R, G, B), always in RGB order (rows are reordered
for a BGR model); the columns multiply (Y, U, V, 1), Y / U / V being the raw 0-255 sample values
(chroma not centred), so the 4th column is the bias that carries the -16 / -128 offsets:
``R = m[0]*Y + m[1]*U + m[2]*V + m[3]``, ``G = m[4]*Y + ...``, ``B = m[8]*Y + ...``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pulsar.frontend.processors.chain import CHANNEL_AXIS, Chain

# ITU-R BT.601 luma weights.
KR, KB = 0.299, 0.114
KG = 1.0 - KR - KB
LUMA = {"RGB": [KR, KG, KB], "BGR": [KB, KG, KR]}
CHANNELS = {"RGB": 3, "BGR": 3, "GRAY": 1}


def channel_linear(chain: Chain, matrix: np.ndarray, bias: np.ndarray | None, step: str) -> None:
    """out[c] = sum_k matrix[c, k] * in[k] + bias[c] on the channel axis of a 4-D float tensor."""
    matrix = np.asarray(matrix, dtype=np.float32)
    if chain.layout == "NCHW":
        inputs = [chain.const("csc_w", matrix[:, :, None, None])]
        if bias is not None:
            inputs.append(chain.const("csc_b", bias, np.float32))
        chain.apply("Conv", *inputs, kernel_shape=[1, 1])
    else:
        chain.apply("MatMul", chain.const("csc_w", matrix.T))
        if bias is not None:
            chain.apply("Add", chain.const("csc_b", bias, np.float32))
    chain.steps.append(step)


# ---- RGB / BGR / GRAY ---------------------------------------------------------------------------

ColorFn = Callable[[Chain], None]


def _reverse(src: str, dst: str) -> ColorFn:
    def convert(chain: Chain) -> None:
        chain.apply("Gather", chain.const("reverse", [2, 1, 0], np.int64), axis=CHANNEL_AXIS[chain.layout])
        chain.steps.append(f"{src}->{dst} (channel reverse)")

    return convert


def _luma(src: str) -> ColorFn:
    return lambda chain: channel_linear(chain, np.array([LUMA[src]]), None, f"{src}->GRAY (BT.601 luma)")


def _replicate(dst: str) -> ColorFn:
    return lambda chain: channel_linear(chain, np.ones((3, 1)), None, f"GRAY->{dst} (replicate)")


#: (src, dst) -> (conversion, needs float arithmetic). Pure data moves stay in the input dtype.
COLOR_CONVERSIONS: dict[tuple[str, str], tuple[ColorFn, bool]] = {
    ("BGR", "RGB"): (_reverse("BGR", "RGB"), False),
    ("RGB", "BGR"): (_reverse("RGB", "BGR"), False),
    ("BGR", "GRAY"): (_luma("BGR"), True),
    ("RGB", "GRAY"): (_luma("RGB"), True),
    ("GRAY", "BGR"): (_replicate("BGR"), True),
    ("GRAY", "RGB"): (_replicate("RGB"), True),
}


# ---- CSC matrices -------------------------------------------------------------------------------


def bt601_matrix(y_scale: float, y_offset: float, c_scale: float) -> np.ndarray:
    """BT.601 YUV -> RGB as a 3x4 [Y, U, V, 1] matrix, derived from the Kr / Kb luma weights."""
    rv = 2 * (1 - KR) * c_scale
    bu = 2 * (1 - KB) * c_scale
    gu = -2 * KB * (1 - KB) / KG * c_scale
    gv = -2 * KR * (1 - KR) / KG * c_scale
    m = np.array([[y_scale, 0.0, rv], [y_scale, gu, gv], [y_scale, bu, 0.0]])
    bias = -(m @ np.array([y_offset, 128.0, 128.0]))
    return np.hstack([m, bias[:, None]])


#: csc_mode -> (3x4 matrix from csc_mat, clip the result to 0..255). Matrix is not clipped so that a
#: user matrix may produce any range (e.g. with normalisation folded in).
CSC_MODES: dict[str, tuple[Callable[[list[float]], np.ndarray], bool]] = {
    "FullRange": (lambda _m: bt601_matrix(1.0, 0.0, 1.0), True),  # JPEG / JFIF: Y, U, V all 0..255
    "LimitedRange": (lambda _m: bt601_matrix(255 / 219, 16.0, 255 / 224), True),  # video: Y 16..235
    "Matrix": (lambda m: np.asarray(m, dtype=np.float64).reshape(3, 4), False),
}


def apply_csc(chain: Chain, matrix: np.ndarray, columns: tuple[int, int, int], tensor_format: str,
              clip: bool, step: str) -> None:
    """Apply a [Y, U, V, 1] -> RGB matrix to a tensor whose channels hold (Y, U, V)[columns]."""
    m = matrix[:, [*columns, 3]]
    if tensor_format == "BGR":
        m = m[::-1]
    channel_linear(chain, m[:, :3], m[:, 3], step)
    if clip:
        chain.apply("Clip", chain.const("lo", 0.0, np.float32), chain.const("hi", 255.0, np.float32))
        chain.steps.append("clip 0..255")


# ---- YUV unpacking ------------------------------------------------------------------------------


@dataclass(frozen=True)
class YuvFormat:
    """A deployed YUV format: its tensor shape and how to unpack it into an NHWC (Y, C0, C1) image."""

    shape: Callable[[int | str | None, int, int, str], list[int | str | None]]
    unpack: Callable[[Chain, int, int], None]
    columns: tuple[int, int, int]  # which of (Y, U, V) channels 0, 1, 2 of the unpacked image hold
    even_height: bool  # 4:2:0 halves both axes, 4:2:2 only the width
    description: str


def _nearest_x2(chain: Chain, tensor: str, scales: list[float]) -> str:
    """Chroma upsampling by sample repetition (nearest, output pixel x reads input x // 2)."""
    roi = chain.const("roi", np.zeros(0, np.float32))
    return chain.op("Resize", [tensor, roi, chain.const("scales", scales, np.float32)], mode="nearest",
                    coordinate_transformation_mode="asymmetric", nearest_mode="floor")


def _slice(chain: Chain, tensor: str, axis: int, start: int, end: int) -> str:
    return chain.op("Slice", [tensor, chain.const("starts", [start], np.int64), chain.const("ends", [end], np.int64),
                              chain.const("axes", [axis], np.int64)])


def _semi_planar_shape(n: int | str | None, h: int, w: int, layout: str) -> list[int | str | None]:
    return [n, h * 3 // 2, w, 1] if layout == "NHWC" else [n, 1, h * 3 // 2, w]


def _unpack_semi_planar(chain: Chain, h: int, w: int) -> None:
    # [N, 3H/2, W, 1] and [N, 1, 3H/2, W] hold the same bytes: rows 0..H-1 are Y, then H/2 rows of
    # interleaved chroma pairs, each pair shared by a 2x2 block of pixels.
    planes = chain.op("Reshape", [chain.tensor, chain.const("shape", [0, h * 3 // 2, w, 1], np.int64)])
    y = _slice(chain, planes, 1, 0, h)
    c = _slice(chain, planes, 1, h, h * 3 // 2)
    c = chain.op("Reshape", [c, chain.const("shape", [0, h // 2, w // 2, 2], np.int64)])
    c = _nearest_x2(chain, c, [1.0, 2.0, 2.0, 1.0])
    chain.tensor = chain.op("Concat", [y, c], axis=3)


def _packed_shape(n: int | str | None, h: int, w: int, layout: str) -> list[int | str | None]:
    return [n, h, w, 2] if layout == "NHWC" else [n, 2, h, w]


def _unpack_packed(y_channel: int) -> Callable[[Chain, int, int], None]:
    def unpack(chain: Chain, h: int, w: int) -> None:
        # Pixel (h, w) holds [Y, C] (YUYV) or [C, Y] (UYVY); C is U on even w, V on odd w.
        if chain.layout == "NCHW":
            chain.apply("Transpose", perm=[0, 2, 3, 1])
        y = _slice(chain, chain.tensor, 3, y_channel, y_channel + 1)
        c = _slice(chain, chain.tensor, 3, 1 - y_channel, 2 - y_channel)
        c = chain.op("Reshape", [c, chain.const("shape", [0, h, w // 2, 2], np.int64)])
        c = _nearest_x2(chain, c, [1.0, 1.0, 2.0, 1.0])
        chain.tensor = chain.op("Concat", [y, c], axis=3)

    return unpack


YUV_FORMATS: dict[str, YuvFormat] = {
    "YUV420SP": YuvFormat(_semi_planar_shape, _unpack_semi_planar, (0, 1, 2), True, "NV12 unpack"),
    "YVU420SP": YuvFormat(_semi_planar_shape, _unpack_semi_planar, (0, 2, 1), True, "NV21 unpack"),
    "YUYV422": YuvFormat(_packed_shape, _unpack_packed(0), (0, 1, 2), False, "YUYV unpack"),
    "UYVY422": YuvFormat(_packed_shape, _unpack_packed(1), (0, 1, 2), False, "UYVY unpack"),
}


def unpack_yuv(chain: Chain, src_format: str, h: int, w: int) -> YuvFormat:
    fmt = YUV_FORMATS[src_format]
    fmt.unpack(chain, h, w)
    chain.layout = "NHWC"
    chain.steps.append(f"{fmt.description} (chroma upsampled x2 by nearest)")
    return fmt
