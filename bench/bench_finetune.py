"""Fine-tuning (AdaRound / BRECQ / LSQ) against the default quantization: accuracy, build time, memory.

    python -m bench.bench_finetune [--models mbv2,ocr] [--algorithms default,adaround,brecq,lsq]
        [--epochs 100] [--block-size 4] [--eval-n 200] [--device cpu] [--memory] [--json FILE] [--work-dir DIR]

For each model (the bench_quant specs: same float model, config and 32 calibration samples) it builds,
in the same run, the default config and the same config plus ``quant.enable_<algo>``,
``quant.finetune_epochs``, ``quant.finetune_block_size`` and ``quant.device``, each in a fresh output
folder (so neither the calibration statistics nor the fine-tuning cache of an earlier build is
reused; a build that still loaded the fine-tuning cache is flagged ``cached``), and prints:

- the wall-clock seconds of each whole ``pulsar.build`` (frontend, calibration, fine-tuning, compile);
- the task metric of the compiled model run by ``pulsar.Session`` in ``Reference`` mode (QDQ as
  float math) and in the default ``NPUBackend`` mode (bit-exact integer simulation), and both
  differences to the default row: mbv2 top-1 agreement with the float model (top-1 accuracy too
  where the spec has labels; bench_quant's photo crops have none), ocr exact-match rate against the
  rendered text (the float model's own rate on the same samples is printed above the table);
- per fine-tuning build, from its ``build.log``: blocks, blocks rolled back (the hard-rounded loss
  ended worse than the calibrated one), blocks with nothing to train, fine-tuning seconds;
- ocr: onnxruntime's ``quantize_static`` (MinMax, QDQ, per channel, the same calibration samples) on
  pulsar's optimized float graph, timed in the same run, its Reference-style score, and the ratio
  of each fine-tuning build's seconds to it (a whole pulsar build against quantization alone).

The evaluation samples are disjoint from the calibration ones (bench_quant: crops from the other half
of each photo; text lines from the other half of the vocabulary); the script checks and prints it.

``--memory``: peak resident set size of a child process running ``pulsar build`` of mbv2 with
``enable_lsq`` at calibration_size 256 and 32 (one calibration folder of 256 crops, made the way
``examples/make_assets.py`` makes them, from the installed photos), and the ratio.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort
from PIL import Image

from bench import bench_quant as bq
from examples import assets

ALGORITHMS = ("default", "adaround", "brecq", "lsq")
MAIN_METRIC = {"mbv2": "top1_agree", "ocr": "exact"}
MEMORY_SIZES = (32, 256)

_PEAK = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
         "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


# ---------------------------------------------------------------------------------------------------
# build.log
# ---------------------------------------------------------------------------------------------------

_BLOCK = re.compile(r"block (\d+)/(\d+): \[(.*?)\] -> \[(.*?)\]\s+(\d+) layer\(s\)\s+loss (\S+) -> (\S+)(.*?)\s+"
                    r"([\d.]+) s\s*$")
_SUMMARY = re.compile(r"fine-tuning \((\w+)\): (\d+) blocks in ([\d.]+) s, (\d+) rolled back, (\d+) parameters "
                      r"learned(?:; block inputs of (\d+) samples spilled to disk)?")
_CACHED = re.compile(r"fine-tuning: (\d+) learned parameters from the cache")


def parse_build_log(path: Path) -> dict:
    """Per-block lines and the summary line of the fine-tuning step in a build.log."""
    blocks, summary, cached = [], None, None
    for line in path.read_text(errors="replace").splitlines():
        if m := _BLOCK.search(line):
            rest = m.group(8)
            blocks.append({"index": int(m.group(1)), "of": int(m.group(2)), "inputs": m.group(3),
                           "outputs": m.group(4), "layers": int(m.group(5)), "loss_before": float(m.group(6)),
                           "loss_after": float(m.group(7)), "rolled_back": "rolled back" in rest,
                           "nothing_to_train": "nothing to train" in rest, "seconds": float(m.group(9))})
        elif m := _SUMMARY.search(line):
            summary = {"algorithm": m.group(1), "blocks": int(m.group(2)), "seconds": float(m.group(3)),
                       "rolled_back": int(m.group(4)), "parameters": int(m.group(5)),
                       "spilled_samples": int(m.group(6) or 0)}
        elif m := _CACHED.search(line):
            cached = int(m.group(1))
    return {"blocks": blocks, "summary": summary, "cached_parameters": cached}


# ---------------------------------------------------------------------------------------------------
# Calibration / evaluation disjointness
# ---------------------------------------------------------------------------------------------------


def _digests(arrays: list[np.ndarray]) -> set[str]:
    return {hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest() for a in arrays}


def check_disjoint(name: str, paths: dict[str, Path], float_model: Path, n_eval: int,
                   inputs: list[np.ndarray], labels: list) -> dict:
    """Regenerate both sample sets from their sources, check they are the files / tensors the build
    and the evaluation use, and that no evaluation sample is a calibration sample."""
    calib_tensors = bq.SPECS[name].calib(paths, float_model)
    n_calib = len(calib_tensors)
    res: dict = {"calibration": n_calib, "evaluation": n_eval,
                 "equal_tensors": len(_digests(inputs) & _digests(calib_tensors))}
    if name == "ocr":
        files = bq._files(paths["ocr_calib"], "*.npy")
        lines = assets.render_text_lines(n_calib, assets.CALIB_SEED, part="calib")
        res["calibration_source_matches_files"] = all(
            np.array_equal(assets.ocr_preprocess(img), t)
            for (img, _), t in zip(lines, calib_tensors, strict=True))
        calib_texts = {t for _, t in lines}
        vocab = set(assets._vocabulary("calib"))
        words = {w.lower() for t in labels for w in t.split() if w.isalpha()}
        res["shared_texts"] = len(set(labels) & calib_texts)
        res["eval_words_in_calibration_vocabulary"] = len(words & vocab)
        res["text"] = (f"calibration: {files[0].name} .. {files[-1].name} ({n_calib} lines, seed "
                       f"{assets.CALIB_SEED}, even words of the vocabulary); evaluation: {n_eval} lines (seed "
                       f"{bq.EVAL_SEED}, odd words); {res['shared_texts']} texts and "
                       f"{res['eval_words_in_calibration_vocabulary']} words shared, {res['equal_tensors']} equal "
                       f"input tensors")
        ok = (res["calibration_source_matches_files"] and not res["shared_texts"]
              and not res["eval_words_in_calibration_vocabulary"] and not res["equal_tensors"])
    else:
        files = bq._files(paths["imagenet_calib"], "*.jpg")
        calib_crops = assets.photo_crops(n_calib, assets.CALIB_SEED, part="calib", photos=assets.OBJECT_PHOTOS)
        eval_crops = assets.photo_crops(n_eval, bq.EVAL_SEED, part="eval", photos=assets.OBJECT_PHOTOS)
        # the jpgs are these crops (JPEG quality 95 blurs them a little: each jpg is nearest its own
        # regenerated crop), and the evaluation inputs are these evaluation crops, preprocessed
        crops = np.stack(calib_crops).astype(np.float32)
        errs = np.stack([
            np.abs(np.asarray(Image.open(f).convert("RGB"), np.float32)[None] - crops).mean((1, 2, 3))
            for f in files])
        jpg_err = float(np.diag(errs).max())
        res["calibration_jpg_mean_abs_diff_max"] = jpg_err
        res["calibration_jpgs_match_crops"] = bool(np.array_equal(errs.argmin(1), np.arange(len(files))))
        res["eval_source_matches_inputs"] = all(
            np.array_equal(assets.imagenet_preprocess(c), x)
            for c, x in zip(eval_crops, inputs, strict=True))
        res["equal_crops"] = len(_digests(eval_crops) & _digests(calib_crops))
        res["text"] = (f"calibration: {files[0].name} .. {files[-1].name} ({n_calib} crops of the first half of "
                       f"each photo, seed {assets.CALIB_SEED}; each jpg nearest its regenerated crop, mean |diff| "
                       f"<= {jpg_err:.2f}); evaluation: {n_eval} crops of the other half (seed {bq.EVAL_SEED}); "
                       f"{res['equal_crops']} equal crops, {res['equal_tensors']} equal input tensors")
        ok = (res["calibration_jpgs_match_crops"] and res["eval_source_matches_inputs"]
              and not res["equal_crops"] and not res["equal_tensors"])
    res["disjoint"] = bool(ok)
    if not ok:
        raise AssertionError(f"{name}: evaluation and calibration samples are not disjoint / not the expected "
                             f"sets: {res}")
    return res


# ---------------------------------------------------------------------------------------------------
# Builds and scores
# ---------------------------------------------------------------------------------------------------


@dataclass
class Row:
    model: str
    algorithm: str
    build_s: float | None = None
    reference: dict[str, float] = field(default_factory=dict)
    npu: dict[str, float] = field(default_factory=dict)
    finetune: dict | None = None
    note: str = ""


def _score(name: str, outs: list[np.ndarray], labels: list, ref: list[np.ndarray]) -> dict[str, float]:
    scores = bq.SPECS[name].score(outs, labels, ref)
    if name == "mbv2" and labels and all(lab is not None for lab in labels):
        top1 = np.array([int(np.asarray(o).argmax()) for o in outs])
        scores["top1_acc"] = float(np.mean(top1 == np.asarray(labels)))
    return scores


def _session_outputs(compiled: Path, mode: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
    import pulsar

    sess = pulsar.Session(compiled, mode=mode)
    in_name, out_name = sess.inputs[0].name, sess.outputs[0].name
    return [np.asarray(o[out_name], np.float32) for o in sess.run_many([{in_name: x} for x in inputs])]


def _overrides(algo: str, args: argparse.Namespace) -> dict:
    if algo == "default":
        return {}
    return {f"quant.enable_{algo}": True, "quant.finetune_epochs": args.epochs,
            "quant.finetune_block_size": args.block_size, "quant.device": args.device}


def bench_model(name: str, paths: dict[str, Path], work: Path, args: argparse.Namespace) -> dict:
    import pulsar

    spec = bq.SPECS[name]
    float_model, config = spec.prepare(paths)
    inputs, labels = spec.eval_data(args.eval_n)
    disjoint = check_disjoint(name, paths, float_model, args.eval_n, inputs, labels)
    float_outs = bq._run_ort(float_model, inputs)
    has_labels = bool(labels) and all(lab is not None for lab in labels)
    float_scores = _score(name, float_outs, labels, float_outs) if has_labels else {}
    rows: list[Row] = []
    optimized: Path | None = None
    for algo in args.algorithms:
        print(f"  {name}: building {algo}", file=sys.stderr, flush=True)
        out_dir = work / name / algo
        start = time.perf_counter()
        try:
            res = pulsar.build(input=str(float_model), output_dir=str(out_dir), config=config,
                               overrides=_overrides(algo, args), quiet=True)
        except Exception as exc:  # one failing build must not hide the others' figures
            rows.append(Row(name, algo, note=f"build failed: {type(exc).__name__}: {exc}"))
            continue
        row = Row(name, algo, time.perf_counter() - start)
        optimized = optimized or Path(res.optimized_model)
        if algo != "default":
            row.finetune = parse_build_log(Path(res.output_dir) / "build.log")
            if row.finetune["cached_parameters"] is not None:
                row.note = "fine-tuning loaded from the cache (not retrained)"
            elif row.finetune["summary"] is None:
                row.note = "no fine-tuning summary in build.log"
        for mode, key in (("Reference", "reference"), ("NPUBackend", "npu")):
            try:
                setattr(row, key, _score(name, _session_outputs(Path(res.compiled_model), mode, inputs), labels,
                                         float_outs))
            except Exception as exc:
                row.note = f"{row.note}; {mode} failed: {exc}".lstrip("; ")
        rows.append(row)

    ort_figures = None
    if name == "ocr":
        src = optimized or bq._ort_input_fallback(float_model, work / name / "float_fixed.onnx")
        calib = spec.calib(paths, src)
        dest = work / name / "ort_MinMax.onnx"
        print(f"  {name}: onnxruntime quantize_static MinMax", file=sys.stderr, flush=True)
        seconds = bq._ort_quantize(src, dest, calib, "MinMax")
        ort_figures = {"graph": "pulsar optimized" if optimized else "source (shape fixed, opset 17)",
                       "calibration_samples": len(calib), "seconds": seconds,
                       "reference": _score(name, bq._run_ort(dest, inputs, bq._qdq_options("float")), labels,
                                           float_outs)}
        ort_figures["ratio"] = {r.algorithm: r.build_s / seconds for r in rows
                                if r.algorithm != "default" and r.build_s is not None}
    return {"title": spec.title, "eval_n": args.eval_n, "float": float_scores, "disjoint": disjoint,
            "rows": [asdict(r) for r in rows], "ort_quantize_static": ort_figures}


# ---------------------------------------------------------------------------------------------------
# Peak memory (child process)
# ---------------------------------------------------------------------------------------------------


def bench_memory(work: Path, args: argparse.Namespace) -> dict:
    top = max(MEMORY_SIZES)
    start = time.perf_counter()
    paths = assets.make_example_assets(work / "assets_memory", n_calib=top)
    n_files = len(bq._files(paths["imagenet_calib"], "*.jpg"))
    if n_files < top:
        raise RuntimeError(f"memory: {n_files} calibration images, {top} needed")
    print(f"  memory: {n_files} calibration crops made in {time.perf_counter() - start:.1f} s", file=sys.stderr,
          flush=True)
    float_model, config = bq.SPECS["mbv2"].prepare(paths)
    figures: dict = {"model": "mbv2", "algorithm": "lsq", "sizes": {}}
    for size in MEMORY_SIZES:
        cfg = json.loads(json.dumps(config))
        cfg["quant"]["input_configs"][0]["calibration_size"] = size
        cfg["quant"].update({"enable_lsq": True, "finetune_epochs": args.epochs,
                             "finetune_block_size": args.block_size, "device": args.device})
        cfg_path = work / f"memory_mbv2_lsq_{size}.json"
        cfg_path.write_text(json.dumps(cfg, indent=2))
        out_dir = work / f"memory_mbv2_lsq_{size}"
        cmd = [sys.executable, "-m", "pulsar", "build", "--input", str(float_model), "--config", str(cfg_path),
               "--output_dir", str(out_dir), "--quiet"]
        print(f"  memory: lsq build, calibration_size {size}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", _PEAK, *cmd], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"memory build (calibration_size {size}) failed:\n{done.stderr[-2000:]}")
        log = parse_build_log(out_dir / "build.log")
        figures["sizes"][size] = {"peak_rss_mb": int(done.stdout.strip().splitlines()[-1]) / 1024,
                                  "build_s": time.perf_counter() - t0, "finetune": log["summary"],
                                  "cached": log["cached_parameters"] is not None}
    lo, hi = (figures["sizes"][s]["peak_rss_mb"] for s in (min(MEMORY_SIZES), max(MEMORY_SIZES)))
    figures["ratio"] = hi / lo
    return figures


# ---------------------------------------------------------------------------------------------------
# Printing
# ---------------------------------------------------------------------------------------------------


def _fmt(v: float | None, spec: str = ".3f", signed: bool = False) -> str:
    if v is None:
        return "-"
    return format(v, ("+" if signed else "") + spec)


def _table(head: list[str], body: list[list[str]]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=True)]
    lines = []
    for i, cells in enumerate([head, *body]):
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def format_model(name: str, fig: dict, args: argparse.Namespace) -> str:
    metric = MAIN_METRIC[name]
    extra = [k for k in ("top1_acc", "logit_cos", "char_acc")
             if any(k in r["reference"] for r in fig["rows"])]
    default = next((r for r in fig["rows"] if r["algorithm"] == "default"), None)
    vs = "vs float top-1" if name == "mbv2" else "vs labels"
    lines = [f"{fig['title']} ({name}): {fig['eval_n']} evaluation samples, {fig['disjoint']['calibration']} "
             f"calibration samples; fine-tuning: {args.epochs} steps per block, block size {args.block_size}, "
             f"device {args.device}",
             f"  disjoint: {fig['disjoint']['text']}"]
    if fig["float"]:
        lines.append("  float model on the same samples: "
                     + ", ".join(f"{k} {v:.3f}" for k, v in fig["float"].items()))
    else:
        lines.append("  no labels for these samples: scored against the float model only")
    head = ["model", "algorithm", "build s", f"{metric} Ref ({vs})", "diff", f"{metric} NPU", "diff",
            *(f"{k} Ref" for k in extra), *(f"{k} NPU" for k in extra), "blocks", "rolled back", "nothing to train",
            "finetune s", "note"]
    body = []
    for r in fig["rows"]:
        ft = r["finetune"] or {}
        summary = ft.get("summary") or {}
        diffs = []
        for key in ("reference", "npu"):
            have = default and metric in default[key] and metric in r[key]
            diffs.append(r[key][metric] - default[key][metric] if have else None)
        body.append([
            name, r["algorithm"], _fmt(r["build_s"], ".1f"),
            _fmt(r["reference"].get(metric)), _fmt(diffs[0], signed=True),
            _fmt(r["npu"].get(metric)), _fmt(diffs[1], signed=True),
            *(_fmt(r["reference"].get(k)) for k in extra), *(_fmt(r["npu"].get(k)) for k in extra),
            str(summary.get("blocks", len(ft["blocks"]) if ft else "-")),
            str(summary.get("rolled_back", sum(b["rolled_back"] for b in ft["blocks"]) if ft else "-")),
            str(sum(b["nothing_to_train"] for b in ft["blocks"])) if ft else "-",
            _fmt(summary.get("seconds"), ".1f"),
            r["note"] or ("cached" if ft and ft.get("cached_parameters") is not None else ""),
        ])
    ort_fig = fig["ort_quantize_static"]
    if ort_fig:
        ref = ort_fig["reference"]
        body.append([name, "ORT quantize_static MinMax", _fmt(ort_fig["seconds"], ".1f"), _fmt(ref.get(metric)),
                     _fmt(ref[metric] - default["reference"][metric] if default and default["reference"] else None,
                          signed=True), "-", "-", *(_fmt(ref.get(k)) for k in extra), *("-" for _ in extra),
                     "-", "-", "-", "-", "onnxruntime, QDQ run as float math; seconds: quantize_static alone"])
    lines += ["  " + x for x in _table(head, body)]
    for r in fig["rows"]:
        rolled = [b for b in (r["finetune"] or {}).get("blocks", []) if b["rolled_back"]]
        if rolled:
            lines.append(f"  {r['algorithm']}: rolled back blocks: "
                         + ", ".join(f"{b['index']}/{b['of']} [{b['inputs']}] -> [{b['outputs']}]" for b in rolled))
    if ort_fig:
        lines.append(f"  onnxruntime quantize_static (MinMax, QDQ, per channel, {ort_fig['calibration_samples']} "
                     f"calibration samples, {ort_fig['graph']} graph): {ort_fig['seconds']:.1f} s")
        for algo, ratio in ort_fig["ratio"].items():
            lines.append(f"  {algo} build s / quantize_static s: {ratio:.1f}")
    return "\n".join(lines)


def format_memory(fig: dict) -> str:
    lines = [f"Peak RSS of pulsar build (child process), {fig['model']} {fig['algorithm']}:"]
    head = ["calibration_size", "peak RSS MB", "build s", "finetune s", "samples spilled", "note"]
    body = []
    for size, f in fig["sizes"].items():
        ft = f["finetune"] or {}
        body.append([str(size), f"{f['peak_rss_mb']:.0f}", f"{f['build_s']:.1f}", _fmt(ft.get("seconds"), ".1f"),
                     str(ft.get("spilled_samples", "-")), "cached" if f["cached"] else ""])
    lines += ["  " + x for x in _table(head, body)]
    sizes = sorted(fig["sizes"])
    lines.append(f"  peak RSS ratio {sizes[-1]} / {sizes[0]}: {fig['ratio']:.3f}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="fine-tuning (AdaRound / BRECQ / LSQ) vs the default quantization")
    parser.add_argument("--models", type=bq._csv, default=["mbv2", "ocr"], help="comma list of mbv2, ocr")
    parser.add_argument("--algorithms", type=bq._csv, default=list(ALGORITHMS),
                        help=f"comma list of {', '.join(ALGORITHMS)}")
    parser.add_argument("--epochs", type=int, default=100, help="quant.finetune_epochs (optimizer steps per block)")
    parser.add_argument("--block-size", type=int, default=4, help="quant.finetune_block_size")
    parser.add_argument("--eval-n", type=int, default=200, help="evaluation samples per model")
    parser.add_argument("--device", default="cpu", help="quant.device: cpu, cuda or cuda:N")
    parser.add_argument("--memory", action="store_true",
                        help="also the peak RSS of an mbv2 LSQ build at calibration_size 256 vs 32")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    parser.add_argument("--work-dir", type=Path,
                        help="make this run's fresh folder here and keep it (default: a temporary folder, removed)")
    args = parser.parse_args(argv)
    unknown = [m for m in args.models if m not in MAIN_METRIC]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {list(MAIN_METRIC)}")
    bad = [a for a in args.algorithms if a not in ALGORITHMS]
    if bad:
        parser.error(f"unknown algorithm(s) {bad}; choose from {list(ALGORITHMS)}")
    if args.epochs < 1 or args.block_size < 1 or args.eval_n < 1:
        parser.error("--epochs, --block-size and --eval-n must be at least 1")
    ort.set_default_logger_severity(3)

    if args.work_dir:
        args.work_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-finetune-", dir=args.work_dir))  # fresh: no cache from a past run
    print(f"work dir: {work} (fresh: no statistics or fine-tuning cache from an earlier run"
          f"{'' if args.work_dir else '; removed at the end'})", flush=True)
    results: dict = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                     "work_dir": str(work), "models": {}}
    try:
        paths = assets.make_example_assets(work / "assets", n_calib=bq.N_CALIB)
        for name in args.models:
            print(f"== {bq.SPECS[name].title}", file=sys.stderr, flush=True)
            fig = results["models"][name] = bench_model(name, paths, work, args)
            print(format_model(name, fig, args) + "\n", flush=True)
        if args.memory:
            print("== peak memory", file=sys.stderr, flush=True)
            results["memory"] = bench_memory(work, args)
            print(format_memory(results["memory"]) + "\n", flush=True)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
