"""A metric plugin for ``pulsar sweep`` (or ``evaluation.metric``) on the example MobileNetV2: top-1
agreement with the original float model on held-out photo crops.

    python examples/make_assets.py      # once: examples/assets/mobilenetv2.onnx and its calibration photos
    pulsar sweep --input examples/assets/mobilenetv2.onnx --config configs/mobilenetv2.json \\
        --space configs/mobilenetv2_sweep.yaml --metric examples/sweep_metric.py:top1_agreement \\
        --output_dir sweep_mbv2

pulsar calls ``top1_agreement(session)`` once per model (float, QDQ, compiled), each taking the compiled
model's input: configs/mobilenetv2.json's input_processors make it uint8 RGB pixels, NHWC, 1x224x224x3
(pulsar puts the same processors in front of the float and QDQ models). The crops come from the photos'
evaluation halves, never seen in calibration; the reference is the float ONNX model's own top-1 on them
after torchvision's normalization, so the float model scores 1.0 and a quantized one the fraction of
crops it classifies alike.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `examples` importable however pulsar was started
    sys.path.insert(0, str(ROOT))

from examples.assets import IMAGENET_MEAN, IMAGENET_STD, OBJECT_PHOTOS, photo_crops  # noqa: E402

MODEL = ROOT / "examples" / "assets" / "mobilenetv2.onnx"
N_CROPS = 48
SEED = 1  # the calibration crops use seed 0 on the other halves of the photos
_SET: dict[str, np.ndarray] = {}  # made on the first call (not at import: pulsar imports a plugin to check it)


def _evaluation_set() -> tuple[np.ndarray, np.ndarray]:
    """The crops as deployed pixels [N, 1, 224, 224, 3] uint8 and the float model's top-1 on each."""
    if not _SET:
        import onnxruntime as ort

        pixels = np.stack([crop[None] for crop in photo_crops(N_CROPS, SEED, part="eval", photos=OBJECT_PHOTOS)])
        reference = ort.InferenceSession(str(MODEL), providers=["CPUExecutionProvider"])
        name = reference.get_inputs()[0].name
        mean, std = np.array(IMAGENET_MEAN, np.float32), np.array(IMAGENET_STD, np.float32)
        tops = [int(np.argmax(reference.run(None, {name: ((p - mean) / std).transpose(0, 3, 1, 2)})[0]))
                for p in pixels.astype(np.float32)]
        _SET.update(pixels=pixels, tops=np.array(tops))
    return _SET["pixels"], _SET["tops"]


def top1_agreement(session: Any) -> float:
    """The fraction of crops on which ``session``'s model picks the float model's class."""
    pixels, tops = _evaluation_set()
    (tensor,) = session.inputs
    hits = [int(np.argmax(next(iter(session.run({tensor.name: x}).values())))) == top
            for x, top in zip(pixels, tops, strict=True)]
    return float(np.mean(hits))
