"""Quantization accuracy: pulsar's calibration methods against onnxruntime's quantize_static.

    python -m bench.bench_quant [--models ocr,mbv2] [--eval-n 200] [--work-dir DIR] [--json FILE]

onnxruntime quantizes both pulsar's optimized float graph (``out/frontend/optimized.onnx``: the
same graph pulsar quantizes) and the source model as shipped (input shape fixed, opset 17: what an
onnxruntime user starts from); every quantizer gets the same 32 calibration samples; all are
scored on evaluation samples disjoint from calibration (other photo halves, other words).
``pulsar default`` is the config with no quantization options at all (the acceptance figure); the
other pulsar rows set only ``quant.calibration_method``. Figures:

- ocr: PP-OCRv4 recognizer on rendered English lines, exact-match rate and character accuracy
  (1 - edit distance / length) against the ground truth.
- mbv2: MobileNetV2 on photo crops, top-1 agreement with the float model (and the mean cosine
  between quantized and float logits, a finer signal on these low-confidence crops).

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
from dataclasses import dataclass
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


# ---------------------------------------------------------------------------------------------------
# Models under test: a small registry of specs
# ---------------------------------------------------------------------------------------------------


@dataclass
class Spec:
    """One benchmark model: float file, pulsar config, calibration + evaluation data and its score."""

    name: str
    title: str
    prepare: Callable[[dict[str, Path]], tuple[Path, dict]]  # assets -> (float model, pulsar config)
    calib: Callable[[dict[str, Path], Path], list[np.ndarray]]  # assets, model -> ORT calibration inputs
    eval_data: Callable[[int], tuple[list[np.ndarray], list]]  # n -> (inputs, labels)
    score: Callable[[list[np.ndarray], list, list[np.ndarray]], dict[str, float]]  # outs, labels, float outs


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


def _mbv2_score(outs: list[np.ndarray], _labels: list, ref: list[np.ndarray]) -> dict[str, float]:
    q, f = np.concatenate(outs), np.concatenate(ref)
    cos = (q * f).sum(1) / (np.linalg.norm(q, axis=1) * np.linalg.norm(f, axis=1))
    return {
        "top1_agree": float(np.mean(q.argmax(1) == f.argmax(1))),
        "logit_cos": float(cos.mean()),
    }


register(Spec("ocr", "PP-OCRv4 recognizer", _ocr_prepare, _ocr_calib, _ocr_eval, _ocr_score))
register(Spec("mbv2", "MobileNetV2", _mbv2_prepare, _mbv2_calib, _mbv2_eval, _mbv2_score))


# ---------------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------------


@dataclass
class Row:
    method: str
    scores: dict[str, float]
    build_s: float | None = None
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


def _ort_input_fallback(model: Path, dest: Path) -> Path:
    """Without pulsar: fix the input shape, move to opset 17 and fold constants (onnxslim), as
    pulsar's frontend would, so onnxruntime sees a comparable graph."""
    import onnxslim
    from onnx import version_converter

    m = onnx.load(str(model))
    if any(not d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim):
        dims = m.graph.input[0].type.tensor_type.shape.dim
        for d, v in zip(dims, (1, 3, assets.OCR_H, assets.OCR_W), strict=True):
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
    spec: Spec, model: Path, data: tuple[list, list, list], semantics: list[str]
) -> dict[str, float]:
    inputs, labels, ref = data
    scores: dict[str, float] = {}
    for sem in semantics:
        got = spec.score(_run_ort(model, inputs, _qdq_options(sem)), labels, ref)
        scores.update({f"{k}@{sem}": v for k, v in got.items()})
    return scores


def bench_model(spec: Spec, paths: dict[str, Path], work: Path, args: argparse.Namespace) -> list[Row]:
    float_model, config = spec.prepare(paths)
    inputs, labels = spec.eval_data(args.eval_n)
    ref = _run_ort(float_model, inputs)
    float_scores = spec.score(ref, labels, ref)
    rows = [Row("float", {f"{k}@{sem}": v for sem in args.qdq for k, v in float_scores.items()})]
    data = (inputs, labels, ref)
    check = inputs[: args.check_n]

    build = None if args.no_pulsar else _pulsar_build()
    optimized: Path | None = None
    if build is None and not args.no_pulsar:
        print("  pulsar.build is not available: running the onnxruntime half only", file=sys.stderr)
    for method in args.pulsar_methods if build else ():
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
        row = Row(f"pulsar {method}", _score_quant(spec, Path(res.quantized_model), data, args.qdq), seconds)
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
        graphs["source"] = _ort_input_fallback(float_model, ort_dir / "float_fixed.onnx")
    for graph, src in graphs.items():
        calib = spec.calib(paths, src)
        for method in args.ort_methods:
            dest = ort_dir / f"ort_{graph}_{method}.onnx"
            label = f"ORT {method}" + (" (source graph)" if graph == "source" else "")
            try:
                seconds = _ort_quantize(src, dest, calib, method)
            except Exception as exc:
                rows.append(Row(label, {}, note=f"quantize_static failed: {exc}"))
                continue
            rows.append(Row(label, _score_quant(spec, dest, data, args.qdq), seconds))
    return rows


def format_table(spec: Spec, rows: list[Row], eval_n: int, n_calib: int) -> str:
    keys = list(rows[0].scores)
    head = ["method", *keys, "build s", "Session-ORT(float QDQ)", "Session-ORT(int)", "note"]
    body = [
        [
            r.method,
            *(f"{r.scores[k]:.3f}" if k in r.scores else "-" for k in keys),
            "-" if r.build_s is None else f"{r.build_s:.1f}",
            *(("-", "-") if r.session_diff is None else (f"{d:.3g}" for d in r.session_diff)),
            r.note,
        ]
        for r in rows
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=True)]
    lines = [f"{spec.title} ({spec.name}), {eval_n} evaluation samples, {n_calib} calibration samples"]
    for i, cells in enumerate([head, *body]):
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


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
        results = {}
        for name in args.models:
            spec = SPECS[name]
            print(f"== {spec.title}", file=sys.stderr, flush=True)
            rows = bench_model(spec, paths, work, args)
            print(format_table(spec, rows, args.eval_n, args.n_calib) + "\n", flush=True)
            results[name] = [r.__dict__ for r in rows]
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
