"""NPUBackend (bit-exact integer simulation) against Reference (float QDQ in onnxruntime).

    python -m bench.bench_npu [--models ocr,mbv2] [--eval-n 200] [--work-dir DIR] [--json FILE]

For each model (default config, the bench_quant specs) it prints:

- the task metric of both run modes of the same compiled model on ``--eval-n`` samples, and the
  share of samples with the same answer in both (decoded text, top-1 class);
- per op: each NPU op fed the Reference's values of its inputs (what compiler CheckPerLayer does),
  the share of its output elements equal to / within 1 step of the Reference's;
- end to end: the share of the last NPU tensor's elements within 1 step, and, for scale, the same
  share between the Reference and the Reference itself with one in 10,000 codes of its quantized
  input moved by one step (a quantized network is chaotic: one element rounded the other way early
  spreads into many differences later; input noise would not show it when the inputs sit on the
  quantization grid, as the recognizer's do).
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


def _move_codes(q: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """``q`` with one code in 10,000 (at least one) moved one step up or down (within the dtype)."""
    flat = q.astype(np.int64).ravel()
    idx = rng.choice(flat.size, max(1, flat.size // 10_000), replace=False)
    info = np.iinfo(q.dtype)
    flat[idx] = np.clip(flat[idx] + rng.choice([-1, 1], idx.size), info.min, info.max)
    return flat.reshape(q.shape).astype(q.dtype), int(idx.size)


def _agreement(name: str, a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """Share of samples whose task answer is the same in both modes: the decoded text (recognizer)
    or the top-1 class (classifier)."""
    if name == "ocr":
        if not bq._CHARSET:
            bq._CHARSET.extend(assets.ppocr_charset(assets.ppocr_rec_model()))
        read = [[assets.ctc_decode(o, bq._CHARSET) for o in outs] for outs in (a, b)]
        return float(np.mean([x == y for x, y in zip(*read, strict=True)]))
    return float(np.mean([int(x.argmax()) == int(y.argmax()) for x, y in zip(a, b, strict=True)]))


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
    outs: dict[str, list[np.ndarray]] = {}
    for mode, sess in (("NPUBackend", npu), ("Reference", ref)):
        start = time.perf_counter()
        outs[mode] = [o[out_name] for o in sess.run_many([{in_name: x} for x in inputs])]
        figures[mode] = {**spec.score(outs[mode], labels, float_outs), "seconds": time.perf_counter() - start}
    figures["modes_agree"] = _agreement(name, outs["NPUBackend"], outs["Reference"])
    first_q = next(sg for sg in npu.compiled.subgraphs if sg.kind == "npu").graph.input[0].name
    rng = np.random.default_rng(1)
    moved_outs = []
    for x in inputs:  # the Reference against itself, one input code in 10,000 moved one step
        codes = ref.run({in_name: x}, [first_q])[first_q]
        moved_outs.append(ref.run_isolated({in_name: x}, {first_q: _move_codes(codes, rng)[0]})[out_name])
    figures["reference_self_agree"] = _agreement(name, moved_outs, outs["Reference"])
    npu_tensors = {o.name for sg in npu.compiled.subgraphs if sg.kind == "npu" for o in sg.graph.output}
    last = [o.name for sg in npu.compiled.subgraphs if sg.kind == "npu" for o in sg.graph.output][-1]
    per_op, e2e, noise = [], [], []
    rng = np.random.default_rng(0)
    flipped = 0
    for x in inputs[:agree_n]:
        want = ref.run_all({in_name: x})
        got = npu.run_isolated({in_name: x}, want)
        per_op += [_step_diffs(got[t], want[t]) for t in got
                   if t in want and t.endswith("/q") and got[t].dtype.kind in "iu" and t not in {in_name}]
        e2e.append(_step_diffs(npu.run({in_name: x}, [last])[last], want[last]))
        moved, flipped = _move_codes(want[first_q], rng)
        noise.append(_step_diffs(ref.run_isolated({in_name: x}, {first_q: moved})[last], want[last]))
    d_op, d_e2e, d_noise = (np.concatenate(v) for v in (per_op, e2e, noise))
    figures["per_op"] = {"elements": int(d_op.size), "equal": float((d_op == 0).mean()),
                         "within_1": float((d_op <= 1).mean()), "max": int(d_op.max())}
    figures["end_to_end"] = {"tensor": last, "within_1": float((d_e2e <= 1).mean()), "max": int(d_e2e.max()),
                             "input_tensor": first_q, "codes_moved": flipped,
                             "reference_vs_moved_input_within_1": float((d_noise <= 1).mean()),
                             "reference_vs_moved_input_max": int(d_noise.max())}
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
            print(f"  same answer (decoded text / top-1 class) in both modes: {f['modes_agree']:.3f}; in the "
                  f"Reference and the Reference with one input code in 10,000 moved one step: "
                  f"{f['reference_self_agree']:.3f}")
            p, e = f["per_op"], f["end_to_end"]
            print(f"  per op (fed the Reference's inputs), {p['elements']} elements: equal {p['equal']:.6f}, "
                  f"within 1 step {p['within_1']:.6f}, max {p['max']}")
            print(f"  end to end, {e['tensor']}: within 1 step {e['within_1']:.3f} (max {e['max']}); Reference vs "
                  f"Reference with {e['codes_moved']} of the {e['input_tensor']} codes moved one step: "
                  f"{e['reference_vs_moved_input_within_1']:.3f} (max {e['reference_vs_moved_input_max']})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
