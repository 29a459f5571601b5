"""pulsar sweep on the PP-OCRv4 recognizer with its exact-match rate as a metric plugin.

    python -m bench.bench_sweep [--work-dir DIR] [--eval-n 100] [--workers 2] [--ray [ADDRESS]] [--quick]

The space: calibration method (MinMax, Percentile, MSE) x mixed-precision budget (2 or 8 layers at
16 bits) x LSQ fine-tuning off / on = 12 trials (``--quick``: 2 x 2 x off = 4). The metric plugin
(written next to the sweep) decodes each rendered evaluation line (disjoint from calibration) with
the model's own charset and returns the exact-match rate. Prints the trial table with the Pareto
front and where the report is; run it again to see the resume (nothing rebuilt).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import bench_quant as bq
from examples import assets

PLUGIN = '''"""Exact-match rate of the PP-OCRv4 recognizer on rendered lines (a pulsar sweep metric plugin)."""
import numpy as np
from examples import assets

_DATA = np.load(__file__.replace("ocr_metric.py", "ocr_eval.npz"), allow_pickle=False)
_CHARSET = assets.ppocr_charset(assets.ppocr_rec_model())


def exact_match(session) -> float:
    name = session.inputs[0].name
    reads = [assets.normalize_text(assets.ctc_decode(next(iter(session.run({name: x}).values())), _CHARSET))
             for x in _DATA["x"]]
    return float(np.mean([r == t for r, t in zip(reads, _DATA["text"].tolist())]))
'''


def main(argv: list[str] | None = None) -> int:
    import pulsar

    ap = argparse.ArgumentParser(prog="python -m bench.bench_sweep", description=__doc__.splitlines()[0])
    ap.add_argument("--work-dir", type=Path)
    ap.add_argument("--eval-n", type=int, default=100)
    ap.add_argument("--workers", type=int)
    ap.add_argument("--ray", nargs="?", const="local")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="pulsar_bench_sweep_"))
    work.mkdir(parents=True, exist_ok=True)
    paths = assets.make_example_assets(work / "assets", n_calib=16)
    model, config = bq._ocr_prepare(paths)
    (work / "base.json").write_text(json.dumps({**config, "quant": {
        **config["quant"], "auto_mixed_precision": {"enable": True}}}))
    xs, texts = bq._ocr_eval(args.eval_n)
    np.savez(work / "ocr_eval.npz", x=np.stack(xs), text=np.array(texts))
    (work / "ocr_metric.py").write_text(PLUGIN)
    space = {"quant.calibration_method": ["MinMax", "Percentile"] if args.quick else ["MinMax", "Percentile", "MSE"],
             "quant.auto_mixed_precision.max_16bit_layers": [2, 8],
             "quant.enable_lsq": [False] if args.quick else [False, True]}
    (work / "space.json").write_text(json.dumps(space))
    t0 = time.perf_counter()
    rows = pulsar.sweep(model, work / "base.json", work / "space.json", work / "sweep",
                        metric=f"{work / 'ocr_metric.py'}:exact_match", workers=args.workers, ray=args.ray)
    took = time.perf_counter() - t0
    fields = list(space)
    print(f"{'trial':>5}  " + "  ".join(f"{f.split('.')[-1]:>16}" for f in fields)
          + f"  {'status':>7} {'exact':>7} {'float':>7} {'latency ms':>10} {'size':>9} {'build s':>8} pareto")
    for r in rows:
        print(f"{r['trial']:>5}  " + "  ".join(f"{r['settings'][f]!s:>16}" for f in fields)
              + f"  {r['status']:>7} {r['metric'] or 0:7.3f} {r.get('metric_float') or 0:7.3f} "
              f"{r['latency_ms'] or 0:10.4f} {r['size_bytes'] or 0:9d} {r['build_s'] or 0:8.1f} "
              + ("yes" if r["pareto"] else "") + (" (resumed)" if r.get("resumed") else ""))
    print(f"{len(rows)} trials in {took:.0f} s; report: {work / 'sweep' / 'sweep.html'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
