"""Per-tensor quantization parameters (scale, zero point, grid) and how they are derived.

Conventions (stable, also written to quant_config.json):
  real = (q - zero_point) * scale, q clipped to [quant_min, quant_max].
  Activations: U8 asymmetric per tensor. Weights: S8 symmetric per output channel (S4 / S16 the
  same; U4 affine, a zero point per channel; per tensor on request).
  Biases: S32 with scale = input scale x weight scale (per channel), zero point 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pulsar.core.dtypes import DATA_TYPES
from pulsar.errors import PulsarError

# name -> (quant_min, quant_max, signed, numpy type the values are computed in) and name -> bits: views
# of the data types (pulsar/core/dtypes.py); 4-bit values are held in 8-bit arrays and stored as onnx
# INT4 / UINT4 (two per byte) by the exports
DTYPES: dict[str, tuple[int, int, bool, type]] = {n: (t.qmin, t.qmax, t.signed, t.compute)
                                                  for n, t in DATA_TYPES.items()}
BITS = {n: t.bits for n, t in DATA_TYPES.items()}

MIN_SCALE = 1e-12


@dataclass
class TensorQuant:
    """How one tensor is quantized."""

    name: str
    dtype: str                       # U8 | S8 | U16 | S16 | S32
    scale: np.ndarray                # shape () per tensor, (C,) per channel
    zero_point: np.ndarray           # same shape as scale
    axis: int | None = None          # per-channel axis
    symmetric: bool = False
    state: str = "ACTIVATED"         # ACTIVATED | OVERLAPPED | PASSIVE | FP32
    kind: str = "activation"         # activation | weight | bias
    range: tuple[float, float] | None = None  # calibrated float range (activations)
    dominator: str | None = None     # tensor whose scale this one shares
    extra: dict[str, Any] = field(default_factory=dict)
    block_size: int = 0              # > 0: a scale per block of this many along ``axis`` (scale: the
                                     # tensor's shape with that axis divided by it; onnx's blocked grids)

    @property
    def qmin(self) -> int:
        return DTYPES[self.dtype][0]

    @property
    def qmax(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def np_dtype(self) -> type:
        return DTYPES[self.dtype][3]

    def to_json(self) -> dict[str, Any]:
        per_channel = self.axis is not None
        return {
            "kind": self.kind,
            "dtype": self.dtype,
            "bit_width": BITS[self.dtype],
            "policy": {"PER_TENSOR": not per_channel, "PER_CHANNEL": per_channel, "LINEAR": True,
                       "SYMMETRICAL": self.symmetric, "ASYMMETRICAL": not self.symmetric, "POWER_OF_2": False},
            "state": self.state,
            "quant_min": self.qmin,
            "quant_max": self.qmax,
            "axis": self.axis,
            "scale": np.asarray(self.scale, dtype=np.float64).tolist(),
            "zero_point": np.asarray(self.zero_point).astype(np.int64).tolist(),
            "range": list(self.range) if self.range is not None else None,
            "dominator": self.dominator or self.name,
            **({"block_size": self.block_size} if self.block_size else {}),
            **self.extra,
        }


def activation_quant(name: str, lo: float, hi: float, dtype: str = "U8",
                     symmetric: bool | None = None) -> TensorQuant:
    """The grid covering [lo, hi] with zero exactly representable: affine (a zero point fitted to the
    range) or symmetric (zero point 0 for signed types, the middle code for unsigned ones).
    ``symmetric`` None: unsigned types affine, signed ones symmetric."""
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    qmin, qmax, signed, np_type = DTYPES[dtype]
    symmetric = signed if symmetric is None else symmetric
    if symmetric:
        t = max(abs(lo), abs(hi))
        zp = 0 if signed else (qmax + 1) // 2
        scale = max(t / (qmax - zp), MIN_SCALE)
        return TensorQuant(name, dtype, np.float32(scale), np.array(zp, dtype=np_type), symmetric=True,
                           range=(lo, hi))
    scale = max((hi - lo) / (qmax - qmin), MIN_SCALE)
    zp = int(np.clip(np.round(qmin - lo / scale), qmin, qmax))
    return TensorQuant(name, dtype, np.float32(scale), np.array(zp, dtype=np_type), range=(lo, hi))


def float_grid(name: str, dtype: str, kind: str = "activation") -> TensorQuant:
    """A tensor of an FP16 / BF16 layer: values of that format (scale 1, no zero point)."""
    return TensorQuant(name, dtype, np.float32(1.0), np.array(0, dtype=np.int32), symmetric=True, state="FLOAT",
                       kind=kind)


def weight_quant(name: str, w: np.ndarray, axis: int | None, dtype: str = "S8",
                 refine_threshold: float = 1e-6, method: str = "MinMax",
                 method_params: dict[str, Any] | None = None) -> tuple[TensorQuant, np.ndarray]:
    """Weights on their grid: symmetric (S4 / S8 / S16) or affine (U4) per channel along ``axis``
    (None: one scale for the tensor). Channels whose max |w| is below ``refine_threshold`` get that
    threshold as their range so a near-zero channel does not get a degenerate scale.

    4-bit grids have 16 levels, so the range is not the channel's max |w| but the clipping that
    minimises the channel's squared rounding error (:func:`_mse_clip`): a single outlier would
    otherwise leave most weights on three or four levels. Another ``method`` (a calibration method's
    name, :mod:`pulsar.quant.weight_calibration`) chooses each row's range instead.

    The division and clipping run in float64: in float32 the S32 bound 2**31 - 1 rounds up to 2**31,
    so the largest value of every channel (mapped to quant_max) would overflow the int32 cast and
    wrap to -2**31, flipping its sign.
    """
    qmin, qmax, signed, np_dtype = DTYPES[dtype]
    w = np.asarray(w)
    bad = int(w.size - np.count_nonzero(np.isfinite(w)))
    if bad:
        raise PulsarError(
            f'initializer "{name}" holds {bad} NaN / inf value(s) out of {w.size}, which cannot be '
            "quantized; fix the model's weights, or keep its layer in float with a quant.layer_configs "
            'entry {"layer_name": ..., "data_type": "FP32"}'
        )
    w64 = w.astype(np.float64)
    rows = (np.moveaxis(w64, axis, 0).reshape(w.shape[axis], -1) if axis is not None else w64.reshape(1, -1))
    floor = refine_threshold if refine_threshold > 0 else 0.0
    if signed:
        lo, hi = -np.abs(rows).max(axis=1, initial=0.0), np.abs(rows).max(axis=1, initial=0.0)
        # An all-zero channel is exact on any grid; it takes the widest channel's range (1.0 when the
        # whole tensor is zero) so its bias grid (input scale x weight scale) stays as coarse as its
        # neighbours' instead of a 1e-12 step that no int32 bias could span.
        hi = np.where(hi > 0, hi, hi.max(initial=0.0) or 1.0)
        hi = np.maximum(hi, floor)
        lo = -hi
    else:
        lo, hi = np.minimum(rows.min(axis=1, initial=0.0), 0.0), np.maximum(rows.max(axis=1, initial=0.0), 0.0)
        flat = (hi - lo) <= floor
        lo, hi = np.where(flat, -floor, lo), np.where(flat, floor, hi)
    if method != "MinMax" and rows.size:
        from pulsar.quant.weight_calibration import method_ranges

        m_lo, m_hi = method_ranges(rows, method, BITS[dtype], signed, method_params or {})
        if signed:  # an all-zero row keeps the MinMax choice above (the widest channel's range)
            t = np.maximum(m_hi, -m_lo)
            hi = np.where(t > 0, np.maximum(t, floor), hi)
            lo = -hi
        else:
            wide = (m_hi - m_lo) > floor
            lo, hi = np.where(wide, m_lo, lo), np.where(wide, m_hi, hi)
    elif BITS[dtype] <= 4 and rows.size:
        lo, hi = _mse_clip(rows, lo, hi, qmin, qmax, signed)
    if signed:
        scale = np.maximum(hi / qmax, MIN_SCALE).astype(np.float32)
        zp = np.zeros_like(scale, dtype=np_dtype)
    else:
        scale = np.maximum((hi - lo) / (qmax - qmin), MIN_SCALE).astype(np.float32)
        zp = np.clip(np.round(qmin - lo / scale.astype(np.float64)), qmin, qmax).astype(np_dtype)
    shape = [1] * w.ndim
    if axis is not None:
        shape[axis] = -1
    else:
        scale, zp = scale.reshape(()), zp.reshape(())
    ratio = w64 / scale.astype(np.float64).reshape(shape if axis is not None else ())
    offset = zp.astype(np.float64).reshape(shape if axis is not None else ())
    q = np.clip(np.round(ratio) + offset, qmin, qmax).astype(np_dtype)
    tq = TensorQuant(name, dtype, scale, zp, axis=axis, symmetric=signed, kind="weight")
    return tq, q


def weight_quant_blocked(name: str, w: np.ndarray, axis: int, block: int, dtype: str,
                         refine_threshold: float = 1e-6) -> tuple[TensorQuant, np.ndarray]:
    """Weights with one scale per block of ``block`` consecutive elements along ``axis`` (the input /
    reduction axis: each output channel's inputs in groups), each block's grid chosen as
    :func:`weight_quant` chooses a channel's."""
    if w.shape[axis] % block:
        raise PulsarError(f'initializer "{name}": weight_group_size {block} does not divide its {w.shape[axis]} '
                          f"inputs (axis {axis}); pick a divisor of {w.shape[axis]}")
    moved = np.moveaxis(np.asarray(w), axis, 0)                       # [K, ...rest]
    rest = moved.shape[1:]
    blocks = moved.reshape(moved.shape[0] // block, block, -1)         # [K/G, G, R]
    rows = blocks.transpose(0, 2, 1).reshape(-1, block)                # one row per (block, output element)
    tq, q_rows = weight_quant(name, rows, 0, dtype, refine_threshold)
    nb = moved.shape[0] // block
    scale = np.moveaxis(np.asarray(tq.scale).reshape(nb, *rest), 0, axis)
    zp = np.moveaxis(np.asarray(tq.zero_point).reshape(nb, *rest), 0, axis)
    q = np.moveaxis(q_rows.reshape(nb, -1, block).transpose(0, 2, 1).reshape(moved.shape), 0, axis)
    return TensorQuant(name, dtype, scale.astype(np.float32), zp, axis=axis, symmetric=tq.symmetric, kind="weight",
                       block_size=block), q


CLIP_RATIOS = np.linspace(0.3, 1.0, 36)


def _mse_clip(rows: np.ndarray, lo: np.ndarray, hi: np.ndarray, qmin: int, qmax: int,
              signed: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the range ``ratio * (lo, hi)`` (ratio in :data:`CLIP_RATIOS`) whose grid gives the
    smallest squared error on the row's own values."""
    best = np.full(rows.shape[0], np.inf)
    out_lo, out_hi = lo.copy(), hi.copy()
    for r in CLIP_RATIOS:
        c_lo, c_hi = lo * r, hi * r
        if signed:
            scale = np.maximum(c_hi / qmax, MIN_SCALE)
            zp = np.zeros_like(scale)
        else:
            scale = np.maximum((c_hi - c_lo) / (qmax - qmin), MIN_SCALE)
            zp = np.clip(np.round(qmin - c_lo / scale), qmin, qmax)
        q = np.clip(np.round(rows / scale[:, None]) + zp[:, None], qmin, qmax)
        err = (((q - zp[:, None]) * scale[:, None] - rows) ** 2).sum(axis=1)
        better = err < best
        best = np.where(better, err, best)
        out_lo, out_hi = np.where(better, c_lo, out_lo), np.where(better, c_hi, out_hi)
    return out_lo, out_hi


def bias_axis(shape: tuple[int, ...], channels: int) -> int | None:
    """The axis of a bias of ``shape`` that runs along the ``channels`` output channels, or None when
    it does not vary along them (a scalar, ``[1]`` beside several channels, ``[M, 1]``). A bias
    broadcasts against the output from the right, so its channel axis is its last one: ``[N]`` -> 0,
    ``[1, N]`` and ``[M, N]`` -> 1."""
    if not shape or shape[-1] != channels or (channels == 1 and len(shape) > 1):
        return None
    return len(shape) - 1


def bias_scale(in_scale: float, w_scale: np.ndarray, axis: int | None) -> np.ndarray:
    """The int32 grid of a bias: input scale x weight scale per channel; one step (the finest channel's)
    when the bias does not run along the channels."""
    scale = np.maximum(np.float64(in_scale) * np.asarray(w_scale, np.float64).reshape(-1), MIN_SCALE)
    return scale if axis is not None else np.asarray(scale.min())


def bias_fits_s32(b: np.ndarray, in_scale: float, w_scale: np.ndarray) -> bool:
    """Whether the bias is representable on the accumulator grid in int32. With 16-bit inputs and
    weights the grid step is ~1e-9 and a bias of a few units overflows: such biases stay float in the
    QDQ model (an NPU adds them in its wider accumulator)."""
    w_scale = np.asarray(w_scale).reshape(-1)
    axis = bias_axis(tuple(b.shape), w_scale.size)
    scale = bias_scale(in_scale, w_scale, axis)
    return bool(np.all(np.abs(b.astype(np.float64) / scale) <= DTYPES["S32"][1]))


def bias_quant(name: str, b: np.ndarray, in_scale: float, w_scale: np.ndarray,
               bits: int = 32) -> tuple[TensorQuant, np.ndarray]:
    """int32 bias on the accumulator's grid (input scale x weight scale), in the bias's own shape:
    per channel along its channel axis (:func:`bias_axis`), else per tensor on the finest channel's step.
    ``bits`` < 32 (a layer's ``bias_bits``): the codes saturate to that many bits, as a narrower
    bias register would hold them."""
    w_scale = np.asarray(w_scale).reshape(-1)
    axis = bias_axis(tuple(b.shape), w_scale.size)
    scale = bias_scale(in_scale, w_scale, axis).astype(np.float32)
    qmin, qmax = DTYPES["S32"][:2]
    if bits < 32:
        qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    shape = [1] * b.ndim
    if axis is not None:
        shape[axis] = -1
    q = np.clip(np.round(b.astype(np.float64) / scale.astype(np.float64).reshape(shape if axis is not None else ())),
                qmin, qmax).astype(np.int32)
    tq = TensorQuant(name, "S32", scale, np.zeros(scale.shape, dtype=np.int32), axis=axis, symmetric=True,
                     kind="bias")
    return tq, q


def expanded(tq: TensorQuant, values: np.ndarray) -> np.ndarray:
    """A blocked grid's per-block ``values`` (scales, zero points) repeated to the tensor's shape."""
    assert tq.axis is not None
    return np.repeat(np.asarray(values), tq.block_size, axis=tq.axis)


def requantize(tq: TensorQuant, arr: np.ndarray) -> np.ndarray:
    """Integers of ``arr`` on the grid of ``tq`` (per channel along ``tq.axis``, or per block)."""
    if tq.block_size:
        scale, zp = expanded(tq, tq.scale).astype(np.float64), expanded(tq, tq.zero_point).astype(np.float64)
        return np.clip(np.round(arr.astype(np.float64) / scale) + zp, tq.qmin, tq.qmax).astype(tq.np_dtype)
    shape = [1] * arr.ndim
    if tq.axis is not None:
        shape[tq.axis] = -1
    scale = np.asarray(tq.scale, np.float64).reshape(shape if tq.axis is not None else ())
    zp = np.asarray(tq.zero_point, np.float64).reshape(shape if tq.axis is not None else ())
    return np.clip(np.round(arr.astype(np.float64) / scale) + zp, tq.qmin, tq.qmax).astype(tq.np_dtype)
