"""The torch executor (fine-tuning's interpreter) against onnxruntime on every built node test.

``python -m bench.conformance.torch_exec [PATTERN ...] [--subset] [--jobs N] [--json FILE]``
(then ``python -m bench.conformance --docs docs/onnx_support.md --torch-json FILE`` for the docs column)

Each eligible ONNX backend node test is built with the default config (calibrated on its own
inputs). On the built graph (what fine-tuning runs), the executor's float outputs are compared with
onnxruntime's on the optimized model: integer and bool outputs exactly, float outputs within
``FLOAT_TOL`` of the output's range (float32; wider for float16 by its epsilon). Its fake-quantized
outputs are compared with the QDQ model in onnxruntime with ``session.disable_quant_qdq`` = 1 (Q and
DQ as ops, no fused integer kernels): within ``QUANT_TOL`` of the range, where a one-step difference
of a quantizer (a tie rounded the other way after float32 noise) is the only thing allowed.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from bench.conformance.cases import Case, collect
from bench.conformance.pool import run_all
from bench.conformance.report import add_torch_column
from bench.conformance.runner import _config, _first_line
from bench.conformance.subset import TORCH_SUBSET

# tests whose mismatch is onnxruntime's or the test's, not the executor's: fnmatch pattern -> why
KNOWN = {
    "test_ai_onnx_ml_tree_ensemble*": "TreeEnsemble (ai.onnx.ml) has no torch function: it runs in onnxruntime; "
                                      "a tree ensemble is piecewise constant, so no gradient is lost",
    "test_training_dropout*": "random mask (training mode): onnxruntime differs from itself",
    "test_cast*FLOAT8*": "onnxruntime returns float8 as raw bits; the executor's values re-encoded are the same bytes",
    "test_castlike*FLOAT8*": "onnxruntime returns float8 as raw bits; the executor's values re-encoded are the same bytes",
    "test_rnn_seq_length": "constant weights saturate the output (range < 5e-3): the executor equals the test's "
                           "expected data, onnxruntime is 1.2e-7 off it",
    "test_simple_rnn_bidirectional": "constant weights saturate the output (range < 5e-3): the executor equals "
                                     "the test's expected data, onnxruntime is 1.2e-7 off it",
    "test_lstm_bidirectional": "constant weights saturate the output: the executor equals the test's expected "
                               "data, onnxruntime is 1.2e-7 off it",
    "test_attention_4d_with_past_and_present_qk_matmul_bias_*_mask_causal": "the debug qk output (mode 2): "
        "onnxruntime writes float32's minimum where the spec (and the test's data) has -inf; Y matches",
}
FLOAT_TOL = 1e-5    # max abs error over the output's range (float32 outputs)
QUANT_TOL = 1e-2    # fake-quantized: a rare one-step difference of an 8-bit grid, nothing larger


def _tol(dtype: np.dtype, base: float) -> float:
    if dtype == np.float16:
        return max(base, 4 * float(np.finfo(np.float16).eps))
    return base


def compare(got: np.ndarray, want: np.ndarray, base: float) -> tuple[bool, float]:
    """(equal within the rule, the error measured): integer / bool exact; float max |got - want| over
    the range of ``want`` (1 where the range is 0), NaN / inf in the same places."""
    want = np.asarray(want)
    got = np.asarray(got)
    if got.shape != want.shape:
        return False, float("inf")
    if want.dtype.kind not in "fc":
        same = bool(np.array_equal(got.astype(want.dtype), want))
        return same, 0.0 if same else 1.0
    g, w = got.astype(np.float64), want.astype(np.float64)
    if not np.array_equal(np.isnan(g), np.isnan(w)) or not np.array_equal(g[np.isinf(w)], w[np.isinf(w)]):
        return False, float("inf")
    fin = np.isfinite(w)
    if not np.isfinite(g[fin]).all():
        return False, float("inf")
    if not fin.any():
        return True, 0.0
    rng = float(w[fin].max() - w[fin].min()) or max(1.0, float(np.abs(w[fin]).max()))
    err = float(np.abs(g[fin] - w[fin]).max() / rng)
    return err <= _tol(want.dtype, base), err


def _session(model: onnx.ModelProto | str, qdq: bool = False) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    if qdq:
        so.add_session_config_entry("session.disable_quant_qdq", "1")
    src = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])


def run_torch_case(case: Case, root: Path) -> dict[str, Any]:
    """Build the test, then the executor in float and fake-quantized mode against onnxruntime."""
    import pulsar
    from pulsar.errors import PulsarError
    from pulsar.quant.torch_exec import QuantExecutor, unsupported_ops
    from pulsar.quant.torch_exec.executor import to_numpy, to_torch

    res: dict[str, Any] = {"name": case.name, "ops": case.ops, "opset": case.opset}
    root.mkdir(parents=True, exist_ok=True)
    src = root / "model.onnx"
    onnx.save(case.model, src)
    try:
        built = pulsar.build(src, root / "out", _config(case, root), {"compiler.check": 0}, quiet=True)
    except PulsarError as e:
        res.update(status="refused", reason=_first_line(e))
        return res
    except Exception as e:  # noqa: BLE001 - the conformance run reports it, the ONNX suite owns it
        res.update(status="refused", reason=f"build: {type(e).__name__}: {_first_line(e)}")
        return res
    qg = built.quant_graph
    res["graph_ops"] = sorted({n.op_type for n in qg.model.graph.node})
    missing = unsupported_ops(qg.model)
    if missing:
        res.update(status="missing", reason=", ".join(sorted(set(missing))))
        res["why"] = "no torch function: " + res["reason"]
        return res
    names = [o.name for o in qg.model.graph.output]
    feeds = {k: v for k, v in case.inputs.items() if k in {i.name for i in qg.model.graph.input}}
    try:
        want_f = _session(qg.model).run(names, feeds)
        want_q = _session(str(built.quantized_model), qdq=True).run(names, feeds)
    except Exception as e:  # noqa: BLE001
        res.update(status="ort", reason=_first_line(e))
        return res
    try:
        exe = QuantExecutor(qg)
        tfeeds = {k: to_torch(v) for k, v in feeds.items()}
        nodes = range(len(exe.nodes))
        got_f = exe.run(nodes, tfeeds, names, quant=False)
        got_q = exe.run(nodes, tfeeds, names, quant=True)
    except Exception as e:  # noqa: BLE001
        res.update(status="error", reason=f"{type(e).__name__}: {_first_line(e)}",
                   trace=traceback.format_exc()[-1500:])
        return res
    rows = []
    for name, wf, wq in zip(names, want_f, want_q, strict=True):
        ok_f, err_f = compare(to_numpy(got_f[name], np.asarray(wf).dtype), wf, FLOAT_TOL)
        ok_q, err_q = compare(to_numpy(got_q[name], np.asarray(wq).dtype), wq, QUANT_TOL)
        _, effect = compare(np.asarray(wq), np.asarray(wf), 0.0)  # how far quantization moved the output
        rows.append({"output": name, "float_ok": ok_f, "float_err": err_f, "quant_ok": ok_q, "quant_err": err_q,
                     "quant_effect": effect, "dtype": str(np.asarray(wf).dtype)})
    res["outputs"] = rows
    res["quantized"] = len(qg.params)
    ok = all(r["float_ok"] for r in rows) and all(r["quant_ok"] for r in rows)
    res["status"] = "ok" if ok else "mismatch"
    if not ok:
        res["why"] = next((why for pat, why in KNOWN.items() if fnmatch.fnmatch(case.name, pat)),
                          "max error / range: float {:.2e}, fake-quantized {:.2e}".format(
                              max(r["float_err"] for r in rows), max(r["quant_err"] for r in rows)))
    return res


def summary(results: list[dict[str, Any]]) -> str:
    counts = Counter(r["status"] for r in results)
    missing = Counter(op for r in results if r["status"] == "missing" for op in
                      {m.split(" (")[0] for m in r["reason"].split(", ")})
    lines = [f"{len(results)} tests: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))]
    if missing:
        lines.append("missing ops (tests): " + ", ".join(f"{k} {v}" for k, v in missing.most_common()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.conformance.torch_exec", description=__doc__.splitlines()[0])
    ap.add_argument("patterns", nargs="*")
    ap.add_argument("--subset", action="store_true", help="the torch CI subset (bench/conformance/subset.py)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--docs", type=Path, help="add the torch column to this support table (docs/onnx_support.md)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    cases, _ = collect([*args.patterns, *TORCH_SUBSET] if args.subset else (args.patterns or None))
    results = []
    with tempfile.TemporaryDirectory(prefix="pulsar_tconf_") as tmp:
        for k, res in enumerate(run_all(cases, Path(tmp), args.jobs, args.timeout,
                                        runner="bench.conformance.torch_exec:run_torch_case"), 1):
            results.append(res)
            worst = max((max(o["float_err"], o["quant_err"]) for o in res.get("outputs", [])), default=0.0)
            print(f"[{k:4d}/{len(cases)}] {res['name']:<58} {res['status']:<9} "
                  f"{res.get('reason', f'{worst:.2e}')[:150]}", flush=True)
    results.sort(key=lambda r: r["name"])
    print(summary(results))
    print(f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")
    if args.docs:
        add_torch_column(args.docs, {r["name"]: r for r in results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
