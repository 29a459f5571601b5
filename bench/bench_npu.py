"""NPUBackend (bit-exact integer simulation) against Reference (float QDQ in onnxruntime).

    python -m bench.bench_npu [--models ocr,mbv2] [--eval-n 200] [--work-dir DIR] [--json FILE]

For each model (default config, the bench_quant specs) it prints:

- the task metric of both run modes of the same compiled model on ``--eval-n`` samples;
- per op: each NPU op fed the Reference's values of its inputs (what compiler CheckPerLayer does),
  the share of its output elements equal to / within 1 step of the Reference's;
- end to end: the share of the last NPU tensor's elements within 1 step, and, for scale, the same
  share between two Reference runs whose inputs differ by 1e-5 noise (a quantized network is
  chaotic: one element rounded the other way early spreads into many 1-step differences later).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from bench import bench_quant as bq
from examples import assets


def _step_diffs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.abs(a.astype(np.int64) - b.astype(np.int64)).ravel()


def bench_model(name: str, paths: dict[str, Path], work: Path, eval_n: int, agree_n: int) -> dict:
    import pulsar

    spec = bq.SPECS[name]
    float_model, config = spec.prepare(paths)
    res = pulsar.build(input=str(float_model), output_dir=str(work / name), config=config, quiet=True)
    npu, ref = pulsar.Session(res.compiled_model), pulsar.Session(res.compiled_model, mode="Reference")
    inputs, labels = spec.eval_data(eval_n)
    in_name, out_name = npu.inputs[0].name, npu.outputs[0].name
    float_outs = bq._run_ort(float_model, inputs)
    figures: dict = {}
    for mode, sess in (("NPUBackend", npu), ("Reference", ref)):
        start = time.perf_counter()
        outs = [sess.run({in_name: x})[out_name] for x in inputs]
        figures[mode] = {**spec.score(outs, labels, float_outs), "seconds": time.perf_counter() - start}
    npu_tensors = {o.name for sg in npu.compiled.subgraphs if sg.kind == "npu" for o in sg.graph.output}
    last = [o.name for sg in npu.compiled.subgraphs if sg.kind == "npu" for o in sg.graph.output][-1]
    per_op, e2e, noise = [], [], []
    rng = np.random.default_rng(0)
    for x in inputs[:agree_n]:
        want = ref.run_all({in_name: x})
        got = npu.run_isolated({in_name: x}, want)
        per_op += [_step_diffs(got[t], want[t]) for t in got
                   if t in want and t.endswith("/q") and got[t].dtype.kind in "iu" and t not in {in_name}]
        e2e.append(_step_diffs(npu.run({in_name: x}, [last])[last], want[last]))
        shaken = (x + 1e-5 * rng.standard_normal(x.shape)).astype(x.dtype)
        noise.append(_step_diffs(ref.run({in_name: shaken}, [last])[last], want[last]))
    d_op, d_e2e, d_noise = (np.concatenate(v) for v in (per_op, e2e, noise))
    figures["per_op"] = {"elements": int(d_op.size), "equal": float((d_op == 0).mean()),
                         "within_1": float((d_op <= 1).mean()), "max": int(d_op.max())}
    figures["end_to_end"] = {"tensor": last, "within_1": float((d_e2e <= 1).mean()), "max": int(d_e2e.max()),
                             "reference_vs_1e-5_noise_within_1": float((d_noise <= 1).mean())}
    figures["npu_subgraph_outputs"] = len(npu_tensors)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="NPUBackend vs Reference")
    parser.add_argument("--models", type=bq._csv, default=["ocr", "mbv2"])
    parser.add_argument("--eval-n", type=int, default=200)
    parser.add_argument("--agree-n", type=int, default=5, help="samples for the element-wise agreement figures")
    parser.add_argument("--work-dir", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    ort.set_default_logger_severity(3)
    with tempfile.TemporaryDirectory(prefix="pulsar-bench-npu-") as tmp:
        work = args.work_dir or Path(tmp)
        paths = assets.make_example_assets(work / "assets", n_calib=bq.N_CALIB)
        results = {}
        for name in args.models:
            print(f"== {bq.SPECS[name].title}", file=sys.stderr, flush=True)
            f = results[name] = bench_model(name, paths, work, args.eval_n, args.agree_n)
            print(f"{bq.SPECS[name].title}: {args.eval_n} samples")
            for mode in ("NPUBackend", "Reference"):
                scores = ", ".join(f"{k} {v:.3f}" for k, v in f[mode].items() if k != "seconds")
                print(f"  {mode:<10}  {scores}  ({f[mode]['seconds']:.1f} s)")
            p, e = f["per_op"], f["end_to_end"]
            print(f"  per op (fed the Reference's inputs), {p['elements']} elements: equal {p['equal']:.6f}, "
                  f"within 1 step {p['within_1']:.6f}, max {p['max']}")
            print(f"  end to end, {e['tensor']}: within 1 step {e['within_1']:.3f} (max {e['max']}); two Reference "
                  f"runs 1e-5 apart: {e['reference_vs_1e-5_noise_within_1']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
