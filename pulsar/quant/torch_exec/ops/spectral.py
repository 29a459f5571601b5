"""Signal-processing ops: DFT, STFT, the Hann / Hamming / Blackman windows and MelWeightMatrix.

Complex tensors are ONNX-style real tensors with a last axis of 2 (real, imaginary); the transforms
run through torch.fft (differentiable) in float32 or float64 and come back in the input's dtype."""

from __future__ import annotations

import math

import numpy as np
import torch

from pulsar.quant.torch_exec.ops.registry import Call, Tensor, _x, op

# ONNX TensorProto data types -> torch (unsigned types wider than 8 bits are held as int64)
_DTYPES = {1: torch.float32, 2: torch.uint8, 3: torch.int8, 4: torch.int64, 5: torch.int16, 6: torch.int32,
           7: torch.int64, 9: torch.bool, 10: torch.float16, 11: torch.float64, 12: torch.int64, 13: torch.int64,
           16: torch.bfloat16}


def _as_complex(x: Tensor) -> Tensor:
    """[..., 1] real or [..., 2] complex as a complex tensor [...] (float16 computed in float32)."""
    x = x if x.dtype in (torch.float32, torch.float64) else x.to(torch.float32)
    if x.shape[-1] == 1:
        return torch.complex(x[..., 0], torch.zeros_like(x[..., 0]))
    return torch.complex(x[..., 0], x[..., 1])


def _fit(z: Tensor, axis: int, n: int) -> Tensor:
    """Zero-pad or truncate ``z`` along ``axis`` to length n."""
    cur = z.shape[axis]
    if cur > n:
        return z.narrow(axis, 0, n)
    if cur < n:
        shape = list(z.shape)
        shape[axis] = n - cur
        return torch.cat([z, z.new_zeros(shape)], dim=axis)
    return z


@op("DFT")
def dft(c: Call) -> list[Tensor]:
    """Opset 17 takes ``axis`` as an attribute (default 1), opset 20 as input 2 (default -2); both
    count the trailing real/imaginary axis. Inverse and onesided together is the inverse real DFT
    (a real output, [..., 1], as onnxruntime)."""
    x = _x(c)
    axis_in = c.ints(2)
    axis = int(axis_in[0]) if axis_in else int(c.attr("axis", 1 if "axis" in c.attrs else -2))
    axis = axis % x.dim()
    length = c.ints(1)
    inverse, onesided = bool(c.attr("inverse", 0)), bool(c.attr("onesided", 0))
    z = _as_complex(x)
    if inverse and onesided:
        n = length[0] if length else 2 * (z.shape[axis] - 1)
        y = torch.fft.irfft(z, n=n, dim=axis).unsqueeze(-1)  # a real signal: [..., 1]
    else:
        n = length[0] if length else z.shape[axis]
        z = _fit(z, axis, n)
        z = torch.fft.ifft(z, dim=axis) if inverse else torch.fft.fft(z, dim=axis)
        if onesided:
            z = z.narrow(axis, 0, n // 2 + 1)
        y = torch.view_as_real(z)
    return [y.to(x.dtype)]


@op("STFT")
def stft(c: Call) -> list[Tensor]:
    """Frames of ``frame_length`` every ``frame_step`` samples, times the window, each through a DFT:
    output [batch, frames, bins, 2]."""
    x, step = _x(c), int((c.ints(1) or [1])[0])
    window = c.input(2)
    length = c.ints(3)
    n = int(length[0]) if length else int(window.shape[0]) if window is not None else x.shape[1]
    z = _as_complex(x)                          # [batch, samples]
    frames = z.unfold(1, n, step)               # [batch, frames, n]
    if window is not None:
        frames = frames * window.to(frames.real.dtype)
    spec = torch.fft.fft(frames, dim=-1)
    if c.attr("onesided", 1):
        spec = spec[..., : n // 2 + 1]
    return [torch.view_as_real(spec).to(x.dtype)]


def _window(c: Call, coeffs: tuple[float, ...]) -> list[Tensor]:
    """A generalized cosine window ``sum_k (-1)^k a_k cos(2 pi k n / N)``, N = size (periodic) or
    size - 1 (symmetric)."""
    size = int((c.ints(0) or [0])[0])
    denom = size if c.attr("periodic", 1) else size - 1
    n = np.arange(size, dtype=np.float64)
    w = np.zeros(size)
    for k, a in enumerate(coeffs):
        w += (-1) ** k * a * np.cos(2 * math.pi * k * n / max(denom, 1))
    dtype = _DTYPES[int(c.attr("output_datatype", 1))]
    return [torch.from_numpy(w).to(dtype)]


@op("HannWindow")
def hann_window(c: Call) -> list[Tensor]:
    return _window(c, (0.5, 0.5))


@op("HammingWindow")
def hamming_window(c: Call) -> list[Tensor]:
    return _window(c, (25 / 46, 21 / 46))


@op("BlackmanWindow")
def blackman_window(c: Call) -> list[Tensor]:
    return _window(c, (0.42, 0.5, 0.08))


@op("MelWeightMatrix")
def mel_weight_matrix(c: Call) -> list[Tensor]:
    """Triangular filters between mel-spaced frequencies, each edge rounded down to a DFT bin
    (as onnxruntime): [dft_length // 2 + 1, num_mel_bins]."""
    bins, dft_len, rate = (int(_x(c, i).reshape(-1)[0]) for i in range(3))
    lo, hi = (float(_x(c, i).reshape(-1)[0]) for i in (3, 4))

    def mel(hz: float) -> float:
        return 2595 * math.log10(1 + hz / 700)

    step = (mel(hi) - mel(lo)) / (bins + 2)
    edges = [int(math.floor((dft_len + 1) * (700 * (10 ** ((mel(lo) + step * i) / 2595) - 1)) / rate))
             for i in range(bins + 2)]
    out = np.zeros((dft_len // 2 + 1, bins))
    for i in range(bins):
        left, center, right = edges[i], edges[i + 1], edges[i + 2]
        if center == left:
            out[center, i] = 1
        else:
            for j in range(left, center + 1):
                out[j, i] = (j - left) / (center - left)
        for j in range(center, right):
            out[j, i] = (right - j) / (right - center)
    dtype = _DTYPES[int(c.attr("output_datatype", 1))]
    return [torch.from_numpy(out).to(dtype)]
