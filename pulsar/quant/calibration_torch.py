"""Calibration's float pass in torch on ``quant.device`` (e.g. ``cuda:0``), statistics reduced on the device.

:func:`pulsar.quant.calibrate.collect_statistics` calls :func:`torch_pass` instead of its
onnxruntime session when the device is not ``cpu``. Each calibrated tensor is counted into its
:class:`TensorStats` on the device as soon as its node has run (only the histogram counts come to
the host) and then dropped, unless a later node reads it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import onnx
import torch

from pulsar.core.ort_errors import is_ort_error, ort_failure
from pulsar.errors import PulsarError
from pulsar.quant.observers.histogram import TensorStats
from pulsar.quant.observers.torch_stats import update_torch
from pulsar.quant.torch_exec.executor import to_torch
from pulsar.quant.torch_exec.float_pass import FloatPass

log = logging.getLogger(__name__)

__all__ = ["device_name", "torch_pass"]


def device_name(device: torch.device) -> str:
    """``cuda`` named with its index (``cuda:0``), for the log."""
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


@contextlib.contextmanager
def _exact_float32() -> Iterator[None]:
    """No TF32 on the GPU during calibration: its 10-bit mantissa would move the ranges away from the
    float model's (onnxruntime on CPU computes in full float32)."""
    cudnn, matmul = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = cudnn, matmul


def torch_pass(
    model: onnx.ModelProto,
    feeds: Iterable[dict[str, np.ndarray]],
    from_feed: list[str],
    fetch: list[str],
    stats: dict[str, TensorStats],
    device: torch.device,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Run the float ``model`` on ``device`` over the (checked) ``feeds``, counting ``from_feed``
    inputs and ``fetch`` tensors into ``stats``; returns the number of samples."""
    runner = FloatPass(model, device)
    if runner.on_ort:
        ops = sorted({v.split(" ")[0] for v in runner.on_ort.values()})
        log.warning("calibration on %s: %d node(s) of op type %s run in onnxruntime on CPU (no torch version); "
                    "their tensors go through the host. quant.device cpu runs the whole pass in onnxruntime",
                    device_name(device), len(runner.on_ort), ", ".join(ops))

    def count(name: str, value: torch.Tensor) -> None:
        update_torch(stats[name], value)

    done = 0
    with torch.inference_mode(), _exact_float32():
        for feed in feeds:
            done += 1
            inputs = {k: to_torch(v, device) for k, v in feed.items()}
            del feed
            for name in from_feed:
                count(name, inputs[name])
            if fetch:
                try:
                    runner.stream(inputs, fetch, count)
                except PulsarError:
                    raise
                except Exception as exc:  # onnxruntime (a node torch lacks) or torch failed on this sample
                    node = runner.nodes[runner.at]
                    where = f"calibration sample {done} on {device_name(device)}, node {node.name!r} ({node.op_type})"
                    if is_ort_error(exc):
                        raise ort_failure(exc, f"in {where}", "set quant.device cpu") from exc
                    raise PulsarError(f"torch failed in {where}: {str(exc).strip().splitlines()[0][:300]}; "
                                      "set quant.device cpu") from exc
            del inputs
            if progress is not None:
                progress(done)
    return done
