"""pulsar sweep on the PP-OCRv4 recognizer with its exact-match rate as a metric plugin.

    python -m bench.bench_sweep [--work-dir DIR] [--eval-n 80] [--workers 2] [--lsq-steps 50]
                                [--no-ray] [--quick]

The space: calibration method (MinMax, Percentile, MSE) x mixed-precision budget (2 or 8 layers at
16 bits) x LSQ fine-tuning off / on (a group: LSQ with its step count) = 12 trials (``--quick``:
2 x 2 x off = 4). The metric plugin, written next to the sweep, decodes rendered evaluation lines
(disjoint from calibration, degraded by downscaling, blur, low contrast and noise so that float reads
about nine in ten and quantization shows) with the model's charset and returns the exact-match rate.

Then it checks what the sweep promises and prints each check: the Pareto flags against a brute-force
recomputation from the table, the PNG opens, the HTML page renders in headless Chromium (a screenshot
next to the report; skipped with a note when no Chromium is installed), a second run rebuilds nothing
(every compiled file's mtime unchanged), and the same sweep with ``--ray`` on a local Ray instance
gives the same table. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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
COMPARED = ("settings", "status", "metric", "metric_float", "metric_qdq", "latency_ms", "size_bytes", "pareto")
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome", "headless_shell")


def degrade(img: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A harder line: downscaled and back, blurred, lower contrast, Gaussian noise (level 0.5-1.05)."""
    from PIL import Image, ImageFilter

    level = rng.uniform(0.5, 1.05)
    im = Image.fromarray(img)
    w, h = im.size
    s = 1 - 0.5 * level
    im = im.resize((max(1, int(w * s)), max(1, int(h * s))), Image.BILINEAR).resize((w, h), Image.BILINEAR)
    a = np.asarray(im.filter(ImageFilter.GaussianBlur(0.6 * level)), dtype=np.float32)
    a = 128 + (a - 128) * (1 - 0.5 * level) + rng.normal(0, 20 * level, a.shape)
    return np.clip(a, 0, 255).astype(np.uint8)


def eval_set(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(2026)
    lines = assets.render_text_lines(n, bq.EVAL_SEED, part="eval")
    return np.stack([assets.ocr_preprocess(degrade(img, rng)) for img, _ in lines]), np.array([t for _, t in lines])


def front(rows: list[dict[str, Any]]) -> set[int]:
    """Brute force: a finished trial no other finished trial matches or beats on both axes."""
    ok = [r for r in rows if r["status"] == "ok"]
    return {r["trial"] for r in ok
            if not any((q["metric"], -q["latency_ms"]) != (r["metric"], -r["latency_ms"])
                       and q["metric"] >= r["metric"] and q["latency_ms"] <= r["latency_ms"] for q in ok)}


def screenshot(html: Path, png: Path) -> str:
    """Render ``html`` in headless Chromium into ``png``; '' when done, else why not."""
    browser = os.environ.get("PULSAR_CHROME") or next(filter(None, map(shutil.which, BROWSERS)), None)
    if not browser:
        return "no Chromium found (apt install chromium, or set PULSAR_CHROME)"
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
                               "--window-size=1600,1200", "--hide-scrollbars", f"--screenshot={png}",
                               html.resolve().as_uri()], capture_output=True, text=True, timeout=120)
    return "" if proc.returncode == 0 and png.is_file() else f"{browser} failed: {proc.stderr.strip()[-300:]}"


def rendered(png: Path) -> str:
    """'' when the screenshot shows the page: its size, the plot's red front line and the table's rows."""
    from PIL import Image

    with Image.open(png) as im:
        a = np.asarray(im.convert("RGB")).astype(int)
    red = int(((a[..., 0] > 180) & (a[..., 1] < 90) & (a[..., 2] < 90)).sum())  # the front, #c33
    pink = int(((a[..., 0] > 245) & (abs(a[..., 1] - 221) < 6) & (abs(a[..., 2] - 238) < 6)).sum())  # front rows
    if a.shape[:2] != (1200, 1600) or red < 50 or pink < 500:
        return f"screenshot {a.shape[1]}x{a.shape[0]}, {red} red plot pixels, {pink} highlighted row pixels"
    return ""


def print_table(rows: list[dict[str, Any]], fields: list[str]) -> None:
    print(f"{'trial':>5}  " + "  ".join(f"{f.split('.')[-1]:>16}" for f in fields)
          + f"  {'status':>7} {'exact':>7} {'float':>7} {'qdq':>7} {'latency ms':>10} {'size':>9} {'build s':>8} pareto")
    for r in rows:
        print(f"{r['trial']:>5}  " + "  ".join(f"{r['settings'].get(f, '')!s:>16}" for f in fields)
              + f"  {r['status']:>7} {r['metric'] or 0:7.3f} {r.get('metric_float') or 0:7.3f} "
              f"{r.get('metric_qdq') or 0:7.3f} {r['latency_ms'] or 0:10.4f} {r['size_bytes'] or 0:9d} "
              f"{r['build_s'] or 0:8.1f} " + ("yes" if r["pareto"] else "") + (" (resumed)" if r.get("resumed") else ""))


def main(argv: list[str] | None = None) -> int:
    import pulsar

    ap = argparse.ArgumentParser(prog="python -m bench.bench_sweep", description=__doc__.splitlines()[0])
    ap.add_argument("--work-dir", type=Path)
    ap.add_argument("--eval-n", type=int, default=80)
    ap.add_argument("--workers", type=int)
    ap.add_argument("--lsq-steps", type=int, default=50, help="quant.finetune_epochs of the LSQ trials")
    ap.add_argument("--no-ray", action="store_true", help="skip the --ray repeat")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="pulsar_bench_sweep_"))
    work.mkdir(parents=True, exist_ok=True)
    paths = assets.make_example_assets(work / "assets", n_calib=16)
    model, config = bq._ocr_prepare(paths)
    (work / "base.json").write_text(json.dumps({**config, "quant": {
        **config["quant"], "auto_mixed_precision": {"enable": True}}}))
    x, text = eval_set(args.eval_n)
    np.savez(work / "ocr_eval.npz", x=x, text=text)
    (work / "ocr_metric.py").write_text(PLUGIN)
    space: dict[str, list[Any]] = {
        "quant.calibration_method": ["MinMax", "Percentile"] if args.quick else ["MinMax", "Percentile", "MSE"],
        "quant.auto_mixed_precision.max_16bit_layers": [2, 8]}
    if not args.quick:
        space["lsq"] = [{"quant.enable_lsq": False}, {"quant.enable_lsq": True, "quant.finetune_epochs": args.lsq_steps}]
    (work / "space.json").write_text(json.dumps(space))
    fields = [*space][:2] + ([] if args.quick else ["quant.enable_lsq", "quant.finetune_epochs"])
    metric = f"{work / 'ocr_metric.py'}:exact_match"

    def run(out: Path, ray: str | None = None) -> tuple[list[dict[str, Any]], float]:
        t0 = time.perf_counter()
        rows = pulsar.sweep(model, work / "base.json", work / "space.json", out, metric=metric,
                            workers=args.workers, ray=ray)
        return rows, time.perf_counter() - t0

    out = work / "sweep"
    rows, took = run(out)
    print_table(rows, fields)
    print(f"{len(rows)} trials in {took:.0f} s; report: {out / 'sweep.html'}")
    failed: list[str] = []

    def check(name: str, problem: str) -> None:
        print(f"  {'ok  ' if not problem else 'FAIL'} {name}" + (f": {problem}" if problem else ""))
        if problem:
            failed.append(name)

    report = json.loads((out / "sweep.json").read_text())
    flagged = {r["trial"] for r in report["trials"] if r["pareto"]}
    check(f"Pareto front {sorted(flagged)} = brute force from the table",
          "" if flagged == front(report["trials"]) else f"brute force gives {sorted(front(report['trials']))}")
    from PIL import Image

    with Image.open(out / "sweep.png") as im:
        im.verify()
        check(f"sweep.png opens as a {im.size[0]}x{im.size[1]} PNG", "" if im.format == "PNG" else im.format)
    shot = out / "sweep_html_screenshot.png"
    why = screenshot(out / "sweep.html", shot)
    if why.startswith("no Chromium"):
        print(f"  skip sweep.html in a headless browser: {why}")
    else:
        check(f"sweep.html renders in headless Chromium ({shot})", why or rendered(shot))
    mtimes = {p: p.stat().st_mtime_ns for p in out.glob("trials/*/compiled.pulsar")}
    again, took2 = run(out)
    check(f"resumed sweep in {took2:.1f} s rebuilds nothing",
          "" if all(r.get("resumed") for r in again) and mtimes == {p: p.stat().st_mtime_ns for p in mtimes}
          else "a trial was rebuilt")
    if not args.no_ray:
        ray_rows, took3 = run(work / "sweep_ray", "local")
        diff = [(a["trial"], k) for a, b in zip(rows, ray_rows, strict=True) for k in COMPARED if a.get(k) != b.get(k)]
        check(f"--ray (local Ray instance, {took3:.0f} s): the same table ({', '.join(COMPARED)})",
              "" if not diff else f"differs at {diff}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
