"""Quantization accuracy: pulsar's calibration methods against onnxruntime's quantize_static.

    python -m bench.bench_quant [--models ocr,mbv2,cls] [--eval-n 200] [--work-dir DIR] [--json FILE]

onnxruntime quantizes both pulsar's optimized float graph (``out/frontend/optimized.onnx``: the
same graph pulsar quantizes) and the source model as shipped (input shape fixed, opset 17: what an
onnxruntime user starts from); every quantizer gets the same 32 calibration samples; all are
scored on every evaluation set of the model, each disjoint from calibration and from the others
(other photos or photo halves, other words, other fonts). ``pulsar default`` is the config with no
quantization options at all (the acceptance figure); the other pulsar rows set only
``quant.calibration_method``. ``quant s`` is the quantization time (pulsar: its quantization stage,
calibration included; onnxruntime: quantize_static); ``build s`` pulsar's whole build. Figures:

- ocr: PP-OCRv4 recognizer on rendered English lines, exact-match rate and character accuracy
  (1 - edit distance / length) against the ground truth. One set (``lines``).
- mbv2: MobileNetV2, top-1 agreement with the float model (and the mean cosine between quantized
  and float logits, a finer signal on these low-confidence crops). Three sets: ``photos`` (square
  crops of the second halves of the object photos; calibration uses the first halves; the set of
  the earlier figures), ``other`` (zoomed-in crops at other aspects and sizes, some upside down,
  of photos no other set uses: microscopy, space, textures, documents, a drawing, a present box)
  and ``third`` (scikit-image's LFW subset, which no other set uses: 200 grey 25 x 25 photo
  thumbnails, 100 faces and 100 background patches of Labeled Faces in the Wild; one centre-ish
  square crop of each at 70-100% of its side, mirrored half the time, upscaled to 224).
- cls: PP-OCR mobile v2 direction classifier (0 / 180 degrees), accuracy against the true
  orientation and agreement with the float model; half of each set is turned 180 degrees. Two sets:
  ``lines`` (evaluation words, the calibration fonts) and ``other`` (words, fonts, sizes and
  light-on-dark lines none of the other sets use).

The summary after the tables puts ``pulsar default`` next to onnxruntime's best row (any
calibrator, either graph) on every model and set, per key metric and QDQ semantics.

Each quantized model is scored twice (``--qdq``): ``@float`` runs the QDQ pairs as written (the
contract pulsar's compiler and Session follow), ``@int`` lets onnxruntime fuse them into its own
integer kernels, as a plain onnxruntime user would run them; the two can differ a lot.

It also checks that ``pulsar.Session`` on each compiled model reproduces onnxruntime on the
matching ``quant/quantized.onnx`` (max abs difference over ``--check-n`` inputs).

Note: onnxruntime's Entropy calibrator keeps its defaults (128 histogram bins, 128 quantized
bins), which leave it a single candidate threshold, so it equals MinMax; quantize_static has no
option to change that.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from PIL import Image

from examples import assets

PULSAR_METHODS = ("default", "MinMax", "Percentile", "MSE", "KL")  # default: the config as shipped
ORT_GRAPHS = ("optimized", "source")
ORT_METHODS = ("MinMax", "Entropy", "Percentile")
N_CALIB = 32
EVAL_SEED = 1
OTHER_SEED = 2  # the second sets' draws (their sources differ anyway)
THIRD_SEED = 3  # mbv2's third set


# ---------------------------------------------------------------------------------------------------
# Models under test: a small registry of specs
# ---------------------------------------------------------------------------------------------------


@dataclass
class EvalSet:
    """One named evaluation set: ``make(n)`` -> (inputs, labels), deterministic; ``sources`` says
    what it is drawn from (printed above its table)."""

    name: str
    sources: str
    make: Callable[[int], tuple[list[np.ndarray], list]]


@dataclass
class Spec:
    """One benchmark model: float file, pulsar config, calibration + evaluation sets and its score."""

    name: str
    title: str
    prepare: Callable[[dict[str, Path]], tuple[Path, dict]]  # assets -> (float model, pulsar config)
    calib: Callable[[dict[str, Path], Path], list[np.ndarray]]  # assets, model -> ORT calibration inputs
    eval_sets: list[EvalSet]
    score: Callable[[list[np.ndarray], list, list[np.ndarray]], dict[str, float]]  # outs, labels, float outs
    keys: tuple[str, ...] = ()  # metrics the summary compares (higher is better)
    calib_sources: str = ""
    calib_inputs: Callable[[int], list[np.ndarray]] | None = field(default=None, repr=False)  # for tests

    def eval_data(self, n: int) -> tuple[list[np.ndarray], list]:
        """The first evaluation set (the one earlier figures and the other benches use)."""
        return self.eval_sets[0].make(n)


SPECS: dict[str, Spec] = {}


def register(spec: Spec) -> Spec:
    SPECS[spec.name] = spec
    return spec


def _files(folder: Path, pattern: str) -> list[Path]:
    """The calibration files make_example_assets wrote (exactly --n-calib of them)."""
    return sorted(folder.glob(pattern))


def _ocr_prepare(paths: dict[str, Path]) -> tuple[Path, dict]:
    name = onnx.load(str(paths["ocr_rec"]), load_external_data=False).graph.input[0].name
    config = {
        "input_shapes": f"{name}:1x3x{assets.OCR_H}x{assets.OCR_W}",
        "quant": {
            "input_configs": [
                {
                    "tensor_name": "DEFAULT",
                    "calibration_dataset": str(paths["ocr_calib"]),
                    "calibration_format": "Numpy",
                    "calibration_size": len(_files(paths["ocr_calib"], "*.npy")),
                }
            ],
        },
    }
    return paths["ocr_rec"], config


def _ocr_calib(paths: dict[str, Path], _model: Path) -> list[np.ndarray]:
    return [np.load(f, allow_pickle=False) for f in _files(paths["ocr_calib"], "*.npy")]


def _ocr_calib_inputs(n: int) -> list[np.ndarray]:
    return [assets.ocr_preprocess(img) for img, _ in assets.render_text_lines(n, assets.CALIB_SEED, part="calib")]


def _ocr_eval(n: int) -> tuple[list[np.ndarray], list]:
    lines = assets.render_text_lines(n, EVAL_SEED, part="eval")
    return [assets.ocr_preprocess(img) for img, _ in lines], [text for _, text in lines]


_CHARSET: list[str] = []


def _ocr_score(outs: list[np.ndarray], texts: list, _ref: list[np.ndarray]) -> dict[str, float]:
    if not _CHARSET:
        _CHARSET.extend(assets.ppocr_charset(assets.ppocr_rec_model()))
    reads = [assets.normalize_text(assets.ctc_decode(o, _CHARSET)) for o in outs]
    exact = sum(r == t for r, t in zip(reads, texts, strict=True)) / len(texts)
    errors = sum(assets.edit_distance(r, t) for r, t in zip(reads, texts, strict=True))
    return {"exact": exact, "char_acc": 1.0 - errors / sum(len(t) for t in texts)}


def _mbv2_prepare(paths: dict[str, Path]) -> tuple[Path, dict]:
    config = {
        "quant": {
            "input_configs": [
                {
                    "tensor_name": "DEFAULT",
                    "calibration_dataset": str(paths["imagenet_calib"]),
                    "calibration_format": "Image",
                    "calibration_size": len(_files(paths["imagenet_calib"], "*.jpg")),
                    "calibration_mean": list(assets.IMAGENET_MEAN),
                    "calibration_std": list(assets.IMAGENET_STD),
                }
            ],
        },
        # mean / std []: Session is fed preprocessed tensors, so no normalization inside the compiled model
        "input_processors": [{"tensor_name": "DEFAULT", "tensor_format": "RGB", "mean": [], "std": []}],
    }
    return paths["mobilenetv2"], config


def _mbv2_calib(paths: dict[str, Path], model: Path) -> list[np.ndarray]:
    """The jpgs as pulsar's Image format reads them: resized to the input H, W, RGB, (x - mean) / std."""
    dims = [
        d.dim_value
        for d in onnx.load(str(model), load_external_data=False).graph.input[0].type.tensor_type.shape.dim
    ]
    h, w = dims[2], dims[3]
    mean, std = np.array(assets.IMAGENET_MEAN, np.float32), np.array(assets.IMAGENET_STD, np.float32)
    out = []
    for jpg in _files(paths["imagenet_calib"], "*.jpg"):
        img = Image.open(jpg).convert("RGB")
        if img.size != (w, h):
            img = img.resize((w, h), Image.BILINEAR)
        arr = (np.asarray(img, dtype=np.float32) - mean) / std
        out.append(np.ascontiguousarray(arr.transpose(2, 0, 1)[None]))
    return out


def _mbv2_eval(n: int) -> tuple[list[np.ndarray], list]:
    crops = assets.photo_crops(n, EVAL_SEED, part="eval", photos=assets.OBJECT_PHOTOS)
    return [assets.imagenet_preprocess(c) for c in crops], [None] * n


def _mbv2_eval_other(n: int) -> tuple[list[np.ndarray], list]:
    crops = assets.other_photo_crops(n, OTHER_SEED)
    return [assets.imagenet_preprocess(c) for c in crops], [None] * n


def _lfw_crops(n: int, seed: int, size: int = 224) -> list[np.ndarray]:
    """``n`` RGB uint8 ``size`` x ``size`` crops of scikit-image's LFW thumbnails (photos no other
    set uses), each thumbnail once (in a seeded order) before any repeats: a square of 70-100% of
    the side, centre-ish (shifted by up to half the slack), mirrored half the time."""
    from skimage import data

    rng = np.random.default_rng(seed)
    thumbs = np.clip(np.asarray(data.lfw_subset()) * 255 + 0.5, 0, 255).astype(np.uint8)  # (200, 25, 25)
    order = rng.permutation(len(thumbs))
    crops = []
    for i in range(n):
        img = thumbs[order[i % len(thumbs)]]
        h, w = img.shape
        side = round(min(h, w) * rng.uniform(0.7, 1.0))
        slack_y, slack_x = h - side, w - side
        y = slack_y // 2 + int(rng.integers(-(slack_y // 2), slack_y // 2 + 1))
        x = slack_x // 2 + int(rng.integers(-(slack_x // 2), slack_x // 2 + 1))
        crop = img[y : y + side, x : x + side]
        if rng.random() < 0.5:
            crop = crop[:, ::-1]
        img_rgb = Image.fromarray(np.ascontiguousarray(crop)).convert("RGB")
        crops.append(np.asarray(img_rgb.resize((size, size), Image.BILINEAR)))
    return crops


def _mbv2_eval_third(n: int) -> tuple[list[np.ndarray], list]:
    crops = _lfw_crops(n, THIRD_SEED)
    return [assets.imagenet_preprocess(c) for c in crops], [None] * n


def _mbv2_calib_inputs(n: int) -> list[np.ndarray]:
    """What the calibration jpgs hold, before JPEG: crops of the first photo halves."""
    crops = assets.photo_crops(n, assets.CALIB_SEED, part="calib", photos=assets.OBJECT_PHOTOS)
    mean, std = np.array(assets.IMAGENET_MEAN, np.float32), np.array(assets.IMAGENET_STD, np.float32)
    return [np.ascontiguousarray(((c.astype(np.float32) - mean) / std).transpose(2, 0, 1)[None]) for c in crops]


def _mbv2_score(outs: list[np.ndarray], _labels: list, ref: list[np.ndarray]) -> dict[str, float]:
    q, f = np.concatenate(outs), np.concatenate(ref)
    cos = (q * f).sum(1) / (np.linalg.norm(q, axis=1) * np.linalg.norm(f, axis=1))
    return {
        "top1_agree": float(np.mean(q.argmax(1) == f.argmax(1))),
        "logit_cos": float(cos.mean()),
    }


def _cls_prepare(paths: dict[str, Path]) -> tuple[Path, dict]:
    name = onnx.load(str(paths["ocr_cls"]), load_external_data=False).graph.input[0].name
    config = {
        "input_shapes": f"{name}:1x3x{assets.CLS_H}x{assets.CLS_W}",
        "quant": {
            "input_configs": [
                {
                    "tensor_name": "DEFAULT",
                    "calibration_dataset": str(paths["cls_calib"]),
                    "calibration_format": "Numpy",
                    "calibration_size": len(_files(paths["cls_calib"], "*.npy")),
                }
            ],
        },
    }
    return paths["ocr_cls"], config


def _cls_calib(paths: dict[str, Path], _model: Path) -> list[np.ndarray]:
    return [np.load(f, allow_pickle=False) for f in _files(paths["cls_calib"], "*.npy")]


def _cls_calib_inputs(n: int) -> list[np.ndarray]:
    return [assets.cls_preprocess(img) for img, _ in assets.direction_lines(n, assets.CALIB_SEED, style="calib")]


def _cls_set(style: str, seed: int) -> Callable[[int], tuple[list[np.ndarray], list]]:
    def make(n: int) -> tuple[list[np.ndarray], list]:
        lines = assets.direction_lines(n, seed, style=style)
        return [assets.cls_preprocess(img) for img, _ in lines], [label for _, label in lines]

    return make


def _cls_score(outs: list[np.ndarray], labels: list, ref: list[np.ndarray]) -> dict[str, float]:
    qp = np.stack([np.asarray(o, np.float64).reshape(-1) for o in outs])  # softmax over (0, 180)
    fp = np.stack([np.asarray(o, np.float64).reshape(-1) for o in ref])
    q, f = qp.argmax(1), fp.argmax(1)
    return {
        "agree": float(np.mean(q == f)),
        "acc": float(np.mean(q == np.asarray(labels))),
        # 1 - mean |p(180) quantized - p(180) float|: a finer signal when every label agrees
        "prob_agree": float(1.0 - np.abs(qp[:, 1] - fp[:, 1]).mean()),
    }


register(
    Spec(
        "ocr",
        "PP-OCRv4 recognizer",
        _ocr_prepare,
        _ocr_calib,
        [EvalSet("lines", "rendered lines, evaluation words (odd), DejaVu fonts", _ocr_eval)],
        _ocr_score,
        keys=("exact", "char_acc"),
        calib_sources="rendered lines, calibration words (even), DejaVu fonts",
        calib_inputs=_ocr_calib_inputs,
    )
)
register(
    Spec(
        "mbv2",
        "MobileNetV2",
        _mbv2_prepare,
        _mbv2_calib,
        [
            EvalSet("photos", "square crops, second halves of the object photos", _mbv2_eval),
            EvalSet("other", "zoomed crops 3:4-4:3, 160-320 px, flips, of photos no other set uses",
                    _mbv2_eval_other),
            EvalSet("third", "centre-ish crops 70-100%, flips, of scikit-image's LFW photo thumbnails",
                    _mbv2_eval_third),
        ],
        _mbv2_score,
        keys=("top1_agree", "logit_cos"),
        calib_sources="square crops, first halves of the object photos",
        calib_inputs=_mbv2_calib_inputs,
    )
)
register(
    Spec(
        "cls",
        "PP-OCR direction classifier",
        _cls_prepare,
        _cls_calib,
        [
            EvalSet("lines", "evaluation words, calibration fonts, half turned 180", _cls_set("eval", EVAL_SEED)),
            EvalSet("other", "other words, fonts, sizes, light on dark, half turned 180",
                    _cls_set("other", OTHER_SEED)),
        ],
        _cls_score,
        keys=("agree", "acc", "prob_agree"),
        calib_sources="calibration words, DejaVu fonts, half turned 180",
        calib_inputs=_cls_calib_inputs,
    )
)


# ---------------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------------


@dataclass
class Row:
    method: str
    scores: dict[str, dict[str, float]]  # evaluation set -> metric@semantics -> value
    quant_s: float | None = None  # pulsar: quantization stage (calibration included); ORT: quantize_static
    build_s: float | None = None  # pulsar: whole build
    session_diff: tuple[float, float] | None = None  # vs ORT QDQ-as-float, vs ORT default
    note: str = ""


def _run_ort(
    model: Path, inputs: list[np.ndarray], options: ort.SessionOptions | None = None
) -> list[np.ndarray]:
    sess = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    return [sess.run(None, {name: x})[0] for x in inputs]


def _pulsar_build():
    """pulsar.build, or None while the Python API is not there yet."""
    try:
        import pulsar

        return pulsar.build
    except (ImportError, AttributeError):
        return None


def _input_shape(config: dict) -> tuple[int, ...] | None:
    """The fixed input shape a pulsar config sets (``input_shapes: "name:1x3x48x320"``), if any."""
    spec = config.get("input_shapes")
    return tuple(int(v) for v in spec.rsplit(":", 1)[1].split("x")) if spec else None


def _ort_input_fallback(model: Path, dest: Path, shape: tuple[int, ...] | None = None) -> Path:
    """Without pulsar: fix the input shape (``shape``, default the recognizer's 1x3x48x320), move to
    opset 17 and fold constants (onnxslim), as pulsar's frontend would, so onnxruntime sees a
    comparable graph."""
    import onnxslim
    from onnx import version_converter

    shape = shape or (1, 3, assets.OCR_H, assets.OCR_W)
    m = onnx.load(str(model))
    if any(d.dim_value <= 0 for d in m.graph.input[0].type.tensor_type.shape.dim):
        dims = m.graph.input[0].type.tensor_type.shape.dim
        for d, v in zip(dims, shape, strict=True):
            d.Clear()
            d.dim_value = v
    opset = next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx"))
    if opset < 17:
        m = version_converter.convert_version(m, 17)
    onnx.save(onnxslim.slim(m), str(dest))
    return dest


def _ort_quantize(src: Path, dest: Path, calib: list[np.ndarray], method: str) -> float:
    from onnxruntime import quantization as q

    name = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).get_inputs()[0].name

    class Reader(q.CalibrationDataReader):
        def __init__(self) -> None:
            self._it = iter(calib)

        def get_next(self):
            x = next(self._it, None)
            return None if x is None else {name: x}

    start = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # its calibrators print progress; keep stdout for the table
        q.quantize_static(
            str(src),
            str(dest),
            Reader(),
            quant_format=q.QuantFormat.QDQ,
            per_channel=True,
            activation_type=q.QuantType.QUInt8,
            weight_type=q.QuantType.QInt8,
            calibrate_method=q.CalibrationMethod[method],
        )
    return time.perf_counter() - start


def _session_diffs(compiled: Path, quantized: Path, inputs: list[np.ndarray]) -> tuple[float, float]:
    """Max |pulsar.Session(compiled) - onnxruntime(quantized)| over a few evaluation inputs, against
    onnxruntime computing QDQ as float math (what Session's Reference mode promises: ~0) and against
    onnxruntime's default fused integer kernels (rounding differences)."""
    import pulsar

    sess = pulsar.Session(compiled, mode="Reference")  # the QDQ fragments, as float math
    name = sess.inputs[0].name
    as_float = ort.SessionOptions()
    as_float.add_session_config_entry("session.disable_quant_qdq", "1")
    refs = (_run_ort(quantized, inputs, as_float), _run_ort(quantized, inputs))
    diffs = [0.0, 0.0]
    for i, x in enumerate(inputs):
        out = np.asarray(next(iter(sess.run({name: x}).values())), np.float32)
        for k, ref in enumerate(refs):
            diffs[k] = max(diffs[k], float(np.abs(out - ref[i]).max()))
    return diffs[0], diffs[1]


def _qdq_options(semantics: str) -> ort.SessionOptions:
    """``float``: QDQ pairs computed as written (pulsar's contract, Session's Reference mode);
    ``int``: onnxruntime fuses them into its integer kernels, as a plain onnxruntime user gets."""
    opts = ort.SessionOptions()
    if semantics == "float":
        opts.add_session_config_entry("session.disable_quant_qdq", "1")
    return opts


def _score_quant(
    spec: Spec, model: Path, data: dict[str, tuple[list, list, list]], semantics: list[str]
) -> dict[str, dict[str, float]]:
    scores: dict[str, dict[str, float]] = {}
    for set_name, (inputs, labels, ref) in data.items():
        scores[set_name] = {}
        for sem in semantics:
            got = spec.score(_run_ort(model, inputs, _qdq_options(sem)), labels, ref)
            scores[set_name].update({f"{k}@{sem}": v for k, v in got.items()})
    return scores


def eval_data(spec: Spec, n: int) -> dict[str, tuple[list, list]]:
    """Every evaluation set of ``spec``: name -> (inputs, labels)."""
    return {s.name: s.make(n) for s in spec.eval_sets}


def bench_model(spec: Spec, paths: dict[str, Path], work: Path, args: argparse.Namespace) -> list[Row]:
    float_model, config = spec.prepare(paths)
    data: dict[str, tuple[list, list, list]] = {}
    float_scores: dict[str, dict[str, float]] = {}
    for name, (inputs, labels) in eval_data(spec, args.eval_n).items():
        ref = _run_ort(float_model, inputs)
        data[name] = (inputs, labels, ref)
        got = spec.score(ref, labels, ref)
        float_scores[name] = {f"{k}@{sem}": v for sem in args.qdq for k, v in got.items()}
    rows = [Row("float", float_scores)]
    check = data[spec.eval_sets[0].name][0][: args.check_n]

    build = None if args.no_pulsar else _pulsar_build()
    optimized: Path | None = None
    if build is None and not args.no_pulsar:
        print("  pulsar.build is not available: running the onnxruntime half only", file=sys.stderr)
    for method in args.pulsar_methods if build else ():
        print(f"  pulsar {method}", file=sys.stderr, flush=True)
        out_dir = work / spec.name / f"pulsar_{method}"
        start = time.perf_counter()
        try:
            res = build(
                input=str(float_model),
                output_dir=str(out_dir),
                config=config,
                overrides={} if method == "default" else {"quant.calibration_method": method},
                quiet=True,
            )
        except Exception as exc:  # one failing method must not hide the others' figures
            rows.append(Row(f"pulsar {method}", {}, note=f"build failed: {exc}"))
            continue
        seconds = time.perf_counter() - start
        optimized = optimized or Path(res.optimized_model)
        row = Row(
            f"pulsar {method}",
            _score_quant(spec, Path(res.quantized_model), data, args.qdq),
            quant_s=res.stage_seconds.get("quantization"),
            build_s=seconds,
        )
        try:
            row.session_diff = _session_diffs(Path(res.compiled_model), Path(res.quantized_model), check)
        except Exception as exc:
            row.note = f"Session check failed: {exc}"
        rows.append(row)

    ort_dir = work / spec.name / "ort"
    ort_dir.mkdir(parents=True, exist_ok=True)
    graphs = {}
    if "optimized" in args.ort_graphs and optimized is not None:
        graphs["optimized"] = optimized  # pulsar's frontend output: both quantizers see the same graph
    if "source" in args.ort_graphs or not graphs:
        # what an onnxruntime user starts from: the shipped model, shapes fixed, opset 17
        graphs["source"] = _ort_input_fallback(float_model, ort_dir / "float_fixed.onnx", _input_shape(config))
    for graph, src in graphs.items():
        calib = spec.calib(paths, src)
        for method in args.ort_methods:
            dest = ort_dir / f"ort_{graph}_{method}.onnx"
            label = f"ORT {method}" + (" (source graph)" if graph == "source" else "")
            print(f"  {label}", file=sys.stderr, flush=True)
            try:
                seconds = _ort_quantize(src, dest, calib, method)
            except Exception as exc:
                rows.append(Row(label, {}, note=f"quantize_static failed: {exc}"))
                continue
            rows.append(Row(label, _score_quant(spec, dest, data, args.qdq), quant_s=seconds))
    return rows


def _align(head: list[str], body: list[list[str]]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=True)]
    lines = []
    for i, cells in enumerate([head, *body]):
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def format_table(spec: Spec, rows: list[Row], eval_n: int, n_calib: int) -> str:
    """One table per evaluation set: every method's metrics on it, with quantization / build times."""
    blocks = []
    for es in spec.eval_sets:
        keys = list(rows[0].scores.get(es.name, {}))
        head = ["method", *keys, "quant s", "build s", "Session-ORT(float QDQ)", "Session-ORT(int)", "note"]
        body = [
            [
                r.method,
                *(f"{r.scores[es.name][k]:.3f}" if k in r.scores.get(es.name, {}) else "-" for k in keys),
                "-" if r.quant_s is None else f"{r.quant_s:.1f}",
                "-" if r.build_s is None else f"{r.build_s:.1f}",
                *(("-", "-") if r.session_diff is None else (f"{d:.3g}" for d in r.session_diff)),
                r.note,
            ]
            for r in rows
        ]
        title = (
            f"{spec.title} ({spec.name}), set {es.name!r}: {es.sources}; {eval_n} evaluation samples, "
            f"{n_calib} calibration samples ({spec.calib_sources})"
        )
        blocks.append("\n".join([title, *_align(head, body)]))
    return "\n\n".join(blocks)


def summary(results: dict[str, tuple[Spec, list[Row]]], semantics: list[str]) -> tuple[str, bool]:
    """pulsar default against onnxruntime's best row, per model, set, key metric and semantics;
    returns the table and whether the default is never behind on the first key metric, QDQ as float."""
    head = ["model", "set", "metric", "float", "pulsar default", "best pulsar method", "best ORT", "ORT row", "default - ORT"]
    body, all_ahead = [], True
    for spec, rows in results.values():
        default = next((r for r in rows if r.method == "pulsar default"), None)
        ort_rows = [r for r in rows if r.method.startswith("ORT") and r.scores]
        other = [r for r in rows if r.method.startswith("pulsar ") and r.method != "pulsar default" and r.scores]
        for es in spec.eval_sets:
            for key in spec.keys:
                for sem in semantics:
                    k = f"{key}@{sem}"
                    f = rows[0].scores[es.name][k]
                    d = default.scores[es.name][k] if default and default.scores else None
                    best = max(ort_rows, key=lambda r: r.scores[es.name][k], default=None)
                    bp = max(other, key=lambda r: r.scores[es.name][k], default=None)
                    o = best.scores[es.name][k] if best else None
                    diff = None if d is None or o is None else d - o
                    if sem == "float" and key == spec.keys[0] and diff is not None and diff < 0:
                        all_ahead = False
                    body.append([
                        spec.name, es.name, k, f"{f:.3f}",
                        "-" if d is None else f"{d:.3f}",
                        "-" if bp is None else f"{bp.scores[es.name][k]:.3f} ({bp.method[7:]})",
                        "-" if o is None else f"{o:.3f}",
                        "-" if best is None else best.method[4:],
                        "-" if diff is None else f"{diff:+.3f}",
                    ])
    return "\n".join(["Summary: pulsar default against onnxruntime's best calibrator", *_align(head, body)]), all_ahead


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="pulsar vs onnxruntime quantization accuracy")
    parser.add_argument("--models", type=_csv, default=list(SPECS), help=f"comma list of {', '.join(SPECS)}")
    parser.add_argument(
        "--eval-n", type=int, default=200, help="evaluation samples per model (>= 100 advised)"
    )
    parser.add_argument("--n-calib", type=int, default=N_CALIB, help="calibration samples (both quantizers)")
    parser.add_argument("--pulsar-methods", type=_csv, default=list(PULSAR_METHODS))
    parser.add_argument("--ort-methods", type=_csv, default=list(ORT_METHODS))
    parser.add_argument("--ort-graphs", type=_csv, default=list(ORT_GRAPHS),
                        help="graphs onnxruntime quantizes: optimized (pulsar's frontend output), source (as shipped)")
    parser.add_argument(
        "--qdq",
        type=_csv,
        default=["float", "int"],
        help="how onnxruntime runs the QDQ models when scoring: float (QDQ math as written), int (fused kernels)",
    )
    parser.add_argument("--check-n", type=int, default=3, help="samples for the Session vs onnxruntime check")
    parser.add_argument("--no-pulsar", action="store_true", help="only the onnxruntime baseline")
    parser.add_argument("--work-dir", type=Path, help="keep builds here (default: a temporary folder)")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    ort.set_default_logger_severity(3)
    unknown = [m for m in args.models if m not in SPECS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {list(SPECS)}")
    bad = [m for m in args.ort_methods if m not in ("MinMax", "Entropy", "Percentile", "Distribution")]
    if bad:
        parser.error(f"unknown onnxruntime method(s) {bad}")
    if args.n_calib < 1 or args.eval_n < 1:
        parser.error("--n-calib and --eval-n must be at least 1")
    if not args.qdq or set(args.qdq) - {"float", "int"}:
        parser.error("--qdq takes float, int or float,int")

    with tempfile.TemporaryDirectory(prefix="pulsar-bench-") as tmp:
        work = args.work_dir or Path(tmp)
        paths = assets.make_example_assets(work / "assets", n_calib=args.n_calib)
        if "cls" in args.models:
            paths.update(assets.make_cls_assets(work / "assets", n_calib=args.n_calib))
        results: dict[str, tuple[Spec, list[Row]]] = {}
        for name in args.models:
            spec = SPECS[name]
            print(f"== {spec.title}", file=sys.stderr, flush=True)
            rows = bench_model(spec, paths, work, args)
            print(format_table(spec, rows, args.eval_n, args.n_calib) + "\n", flush=True)
            results[name] = (spec, rows)
        table, ahead = summary(results, args.qdq)
        print(table, flush=True)
        first = ", ".join(f"{s.name}: {s.keys[0]}" for s, _ in results.values())
        verdict = (
            "is at least as good as onnxruntime's best calibrator on every model and set"
            if ahead
            else "is BEHIND onnxruntime's best calibrator on some model / set"
        )
        print(f"\npulsar default {verdict} ({first}, QDQ as float; margins in 'default - ORT')", flush=True)
    if args.json:
        # per model a list of rows; "scores" holds the first set's figures (the format before several
        # sets), "scores_by_set" every set's
        out: dict = {
            name: [
                {**r.__dict__, "scores": r.scores.get(spec.eval_sets[0].name, {}), "scores_by_set": r.scores}
                for r in rows
            ]
            for name, (spec, rows) in results.items()
        }
        out["summary"] = {
            "eval_sets": {name: {es.name: es.sources for es in spec.eval_sets} for name, (spec, _) in results.items()},
            "default_never_behind_best_ort": ahead,
        }
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
