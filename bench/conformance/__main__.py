"""python -m bench.conformance [PATTERN ...] [--jobs N] [--timeout S] [--json FILE] [--docs FILE]

Builds every eligible ONNX backend node test (all of them, or those matching the fnmatch patterns,
e.g. ``'test_clip*'``) with pulsar's default config, calibrated on the test's own inputs; runs the
compiled model in both modes and compares with the expected outputs. Prints a row per test and a
summary; ``--docs`` writes the per-operator support table (docs/onnx_support.md)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.conformance.cases import INPUT_TYPES, collect
from bench.conformance.pool import run_all
from bench.conformance.report import outcome, summary, write_docs
from bench.conformance.subset import SUBSET


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.conformance", description=__doc__.splitlines()[0])
    ap.add_argument("patterns", nargs="*", help="fnmatch patterns of test names (default: all)")
    ap.add_argument("--subset", action="store_true", help="the representative subset CI runs")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per test before it counts as a hang")
    ap.add_argument("--json", type=Path, help="write every result here")
    ap.add_argument("--docs", type=Path, help="write the support table (markdown) here")
    ap.add_argument("--torch-json", type=Path,
                    help="the torch executor's results (python -m bench.conformance.torch_exec --json) for the docs")
    ap.add_argument("--work-dir", type=Path, help="keep the builds here (default: a temporary folder)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    cases, skipped = collect([*args.patterns, *SUBSET] if args.subset else (args.patterns or None))
    print(f"{len(cases)} eligible node tests, {len(skipped)} skipped (input types)", file=sys.stderr)
    results = []
    with tempfile.TemporaryDirectory(prefix="pulsar_conf_") as tmp:
        work = args.work_dir or Path(tmp)
        for k, res in enumerate(run_all(cases, work, args.jobs, args.timeout), 1):
            results.append(res)
            verdict, detail = outcome(res)
            print(f"[{k:4d}/{len(cases)}] {res['name']:<58} {verdict:<10} {detail}", flush=True)
    results.sort(key=lambda r: r["name"])
    print(summary(results, skipped, time.perf_counter() - t0))
    if args.json:
        args.json.write_text(json.dumps({"results": results, "skipped": skipped}, indent=1, default=str) + "\n")
    if args.docs:
        torch = None
        if args.torch_json:
            torch = {r["name"]: r for r in json.loads(args.torch_json.read_text())}
        write_docs(args.docs, results, skipped, ", ".join(INPUT_TYPES.values()), torch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
