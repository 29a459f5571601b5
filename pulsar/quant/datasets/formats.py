"""Calibration file formats: how the bytes of one file become arrays for model inputs.

Each format is a :class:`Reader` registered in :data:`FORMATS` by name (the values of
``calibration_format``). A reader validates an input against its format once, up front, and then
decodes one file at a time; a reader may feed several inputs from one file (NumpyObject).
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from pulsar.errors import PulsarError
from pulsar.quant.datasets.safe_pickle import load_numpy_object
from pulsar.quant.datasets.spec import DatasetConfig, InputSpec

if TYPE_CHECKING:
    from PIL import Image


class Reader:
    """Base class of a calibration format."""

    name = ""
    extensions: tuple[str, ...] = ()

    def validate(self, spec: InputSpec, config: DatasetConfig) -> None:
        """Refuse an input this format cannot feed (raise PulsarError naming the config field)."""

    def decode(
        self, data: bytes, origin: str, specs: Sequence[InputSpec], config: DatasetConfig
    ) -> dict[str, np.ndarray]:
        """Turn one file's bytes into ``{input_name: array}`` for every input in ``specs``."""
        raise NotImplementedError


FORMATS: dict[str, Reader] = {}


def register_format(name: str) -> Callable[[type[Reader]], type[Reader]]:
    def wrap(cls: type[Reader]) -> type[Reader]:
        reader = cls()
        reader.name = name
        FORMATS[name] = reader
        return cls

    return wrap


def _require_static(spec: InputSpec, config: DatasetConfig) -> None:
    if not spec.shape or any(d <= 0 for d in spec.shape):
        raise PulsarError(
            f"{config.field_path}: input '{spec.name}' has a dynamic shape {list(spec.shape)}; "
            f"{config.calibration_format} data needs a fixed shape (set input_shapes)"
        )


def _no_normalization(config: DatasetConfig) -> None:
    """Tensor formats hold the model's input as it is: calibration_mean / std cannot act on them."""
    for name in ("calibration_mean", "calibration_std"):
        if getattr(config, name):
            raise PulsarError(
                f"{config.field_path}.{name}: only acts on calibration_format Image ({config.calibration_format} "
                f"data is fed to the model as it is); remove it, and to normalize the deployed input inside the "
                f"compiled model set input_processors[].mean / std"
            )


def _fit_shape(arr: np.ndarray, spec: InputSpec, origin: str) -> np.ndarray:
    """Accept the input's shape (dims <= 0 match anything), or the same without a leading batch of 1."""

    def matches(shape: tuple[int, ...], want: tuple[int, ...]) -> bool:
        return len(shape) == len(want) and all(w <= 0 or s == w for s, w in zip(shape, want, strict=True))

    if matches(arr.shape, spec.shape):
        return arr
    if spec.shape and spec.shape[0] in (1, 0, -1) and matches(arr.shape, spec.shape[1:]):
        return arr[np.newaxis]
    raise PulsarError(
        f"{origin}: input '{spec.name}' expects shape {list(spec.shape)}, got {list(arr.shape)}; "
        f"re-save the data with the input's shape"
    )


def _fit_dtype(arr: np.ndarray, spec: InputSpec, origin: str) -> np.ndarray:
    if arr.dtype == spec.dtype:
        return arr
    if arr.dtype == np.float64 and spec.dtype == np.float32:
        return arr.astype(np.float32)  # numpy's default float; harmless to narrow
    raise PulsarError(
        f"{origin}: input '{spec.name}' expects dtype {spec.dtype}, got {arr.dtype}; "
        f"save the array with .astype(np.{spec.dtype.name})"
    )


_IMAGE_EXTENSIONS = {
    ".jpg": "JPEG", ".jpeg": "JPEG", ".png": "PNG", ".bmp": "BMP", ".tif": "TIFF", ".tiff": "TIFF",
    ".webp": "WEBP", ".ppm": "PPM", ".pgm": "PPM", ".pbm": "PPM", ".pnm": "PPM", ".gif": "GIF",
}  # fmt: skip
_CHANNELS = {"RGB": 3, "BGR": 3, "GRAY": 1}
_LAYOUTS = ("NCHW", "NHWC")


def _image_formats() -> list[str]:
    """Decoders allowed for calibration images: common raster formats only (no EPS / Ghostscript)."""
    from PIL import Image  # only image data sets load PIL (a build without them skips its import)

    Image.init()
    return sorted({f for f in _IMAGE_EXTENSIONS.values() if f in Image.OPEN})


@register_format("Image")
class ImageReader(Reader):
    """Decode, convert colour, resize (bilinear), normalise with calibration_mean / calibration_std."""

    extensions = tuple(_IMAGE_EXTENSIONS)

    def validate(self, spec: InputSpec, config: DatasetConfig) -> None:
        where = f"{config.field_path}: input '{spec.name}'"
        if not np.issubdtype(spec.dtype, np.floating):
            raise PulsarError(
                f"{where} has dtype {spec.dtype}; calibration_format Image makes float data, "
                f"use Numpy or Binary for integer inputs"
            )
        if spec.tensor_format not in _CHANNELS:
            raise PulsarError(f"{where}: tensor_format '{spec.tensor_format}' must be one of RGB, BGR, GRAY")
        if spec.tensor_layout not in _LAYOUTS:
            raise PulsarError(f"{where}: tensor_layout '{spec.tensor_layout}' must be NCHW or NHWC")
        _require_static(spec, config)
        if len(spec.shape) != 4 or spec.shape[0] != 1:
            raise PulsarError(
                f"{where} has shape {list(spec.shape)}; Image calibration needs a 4-D input with batch 1 "
                f"({spec.tensor_layout})"
            )
        channels = _CHANNELS[spec.tensor_format]
        got = spec.shape[1] if spec.tensor_layout == "NCHW" else spec.shape[3]
        if got != channels:
            raise PulsarError(
                f"{where} has {got} channels in {spec.tensor_layout} {list(spec.shape)}, but tensor_format "
                f"{spec.tensor_format} has {channels}; fix tensor_format / tensor_layout"
            )
        for field, values in (
            ("calibration_mean", config.calibration_mean),
            ("calibration_std", config.calibration_std),
        ):
            if values and len(values) != channels:
                raise PulsarError(
                    f"{config.field_path}.{field} has {len(values)} values, input '{spec.name}' "
                    f"({spec.tensor_format}) has {channels} channels; give one value per channel"
                )
        if any(s == 0 for s in config.calibration_std):
            raise PulsarError(f"{config.field_path}.calibration_std contains 0; std values must be non-zero")

    def decode(
        self, data: bytes, origin: str, specs: Sequence[InputSpec], config: DatasetConfig
    ) -> dict[str, np.ndarray]:
        from PIL import Image, ImageOps

        try:
            with Image.open(io.BytesIO(data), formats=_image_formats()) as opened:
                image = ImageOps.exif_transpose(opened)  # phone photos: honour the orientation tag
                image.load()
        except (
            Exception
        ) as exc:  # PIL raises many types (UnidentifiedImageError, OSError, DecompressionBomb...)
            raise PulsarError(f"{origin}: cannot decode image ({exc})") from None
        return {spec.name: self._to_tensor(image, spec, config) for spec in specs}

    @staticmethod
    def _to_tensor(image: Image.Image, spec: InputSpec, config: DatasetConfig) -> np.ndarray:
        height, width = (spec.shape[2], spec.shape[3]) if spec.tensor_layout == "NCHW" else spec.shape[1:3]
        from PIL import Image

        mode = "L" if spec.tensor_format == "GRAY" else "RGB"
        resized = image.convert(mode).resize((width, height), Image.Resampling.BILINEAR)
        pixels = np.asarray(resized, dtype=np.float32).reshape(height, width, -1)  # HWC
        if spec.tensor_format == "BGR":
            pixels = pixels[..., ::-1]
        if config.calibration_mean:
            pixels = pixels - np.asarray(config.calibration_mean, dtype=np.float32)
        if config.calibration_std:
            pixels = pixels / np.asarray(config.calibration_std, dtype=np.float32)
        if spec.tensor_layout == "NCHW":
            pixels = pixels.transpose(2, 0, 1)
        return np.ascontiguousarray(pixels[np.newaxis], dtype=spec.dtype)


@register_format("Numpy")
class NumpyReader(Reader):
    """Preprocessed ``.npy`` arrays, loaded with ``allow_pickle=False``."""

    extensions = (".npy",)

    def validate(self, spec: InputSpec, config: DatasetConfig) -> None:
        _no_normalization(config)

    def decode(
        self, data: bytes, origin: str, specs: Sequence[InputSpec], config: DatasetConfig
    ) -> dict[str, np.ndarray]:
        try:
            arr = np.load(io.BytesIO(data), allow_pickle=False)
        except ValueError as exc:
            if "allow_pickle" in str(exc):
                raise PulsarError(
                    f"{origin}: holds Python objects, not a plain array; use calibration_format NumpyObject "
                    f"for files saved from a dict"
                ) from None
            raise PulsarError(f"{origin}: not a valid .npy file ({exc})") from None
        except Exception as exc:
            raise PulsarError(f"{origin}: not a valid .npy file ({exc})") from None
        return {spec.name: _fit_shape(_fit_dtype(arr, spec, origin), spec, origin) for spec in specs}


@register_format("Binary")
class BinaryReader(Reader):
    """Raw bytes; dtype (native byte order) and shape come from the model input."""

    extensions = (".bin",)

    def validate(self, spec: InputSpec, config: DatasetConfig) -> None:
        _no_normalization(config)
        _require_static(spec, config)

    def decode(
        self, data: bytes, origin: str, specs: Sequence[InputSpec], config: DatasetConfig
    ) -> dict[str, np.ndarray]:
        out = {}
        for spec in specs:
            expected = math.prod(spec.shape) * spec.dtype.itemsize
            if len(data) != expected:
                raise PulsarError(
                    f"{origin}: input '{spec.name}' expects {expected} bytes ({list(spec.shape)} {spec.dtype}), "
                    f"the file has {len(data)}; write it with array.astype(np.{spec.dtype.name}).tofile()"
                )
            out[spec.name] = np.frombuffer(data, dtype=spec.dtype).reshape(spec.shape).copy()
        return out


@register_format("NumpyObject")
class NumpyObjectReader(Reader):
    """One ``.npy`` per sample holding ``{input_name: array}`` (loaded without running pickle code)."""

    extensions = (".npy",)

    def validate(self, spec: InputSpec, config: DatasetConfig) -> None:
        _no_normalization(config)

    def decode(
        self, data: bytes, origin: str, specs: Sequence[InputSpec], config: DatasetConfig
    ) -> dict[str, np.ndarray]:
        arrays = load_numpy_object(data, origin)
        wanted = [spec.name for spec in specs]
        missing = [name for name in wanted if name not in arrays]
        extra = sorted(set(arrays) - set(wanted))
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"missing keys {missing}")
            if extra:
                parts.append(f"unexpected keys {extra}")
            raise PulsarError(
                f"{origin}: {' and '.join(parts)}; each NumpyObject file must hold exactly the inputs {wanted}"
            )
        return {
            spec.name: _fit_shape(_fit_dtype(arrays[spec.name], spec, origin), spec, origin) for spec in specs
        }
