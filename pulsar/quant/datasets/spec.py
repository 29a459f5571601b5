"""What a model input expects and how one ``quant.input_configs`` entry describes its data."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DEFAULT_TENSOR = "DEFAULT"


@dataclass(frozen=True)
class InputSpec:
    """A model input as calibration sees it (shape already resolved by the caller)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    tensor_format: str = "BGR"  # RGB | BGR | GRAY: channel order the model expects (Image only)
    tensor_layout: str = "NCHW"  # NCHW | NHWC (Image only)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "dtype", np.dtype(self.dtype))


@dataclass(frozen=True)
class DatasetConfig:
    """One ``quant.input_configs`` entry; ``field_path`` is where it sits in the config, for messages."""

    tensor_name: str
    calibration_dataset: str
    calibration_format: str = "Image"
    calibration_size: int = 32
    calibration_mean: tuple[float, ...] = ()
    calibration_std: tuple[float, ...] = ()
    field_path: str = "quant.input_configs[0]"

    def __post_init__(self) -> None:
        # Lists from a JSON config become tuples so the config stays hashable and comparable.
        object.__setattr__(self, "calibration_mean", tuple(float(v) for v in self.calibration_mean))
        object.__setattr__(self, "calibration_std", tuple(float(v) for v in self.calibration_std))
        object.__setattr__(self, "calibration_dataset", str(self.calibration_dataset))
