"""Frontend on real models: time, graph size before / after, parameters, MACs and output fidelity.

    python -m bench.bench_frontend [--models det,rec,cls,mbv2,encoder] [--simplifiers none,onnxsim,onnxslim]
                                   [--n 4] [--repeat 3] [--ops] [--json FILE]

Each model is loaded with pulsar's loader (opset 17), its input pinned to a fixed shape, optionally
simplified (``onnx_opt.enable_onnxsim`` with ``onnx_opt.simplifier`` onnxsim or onnxslim; "none" is
pulsar's passes alone) and optimized with the transformation check on (the simplifier's result and
every pass that changes the graph are re-run in onnxruntime against the graph before them, on the
first two inputs), as ``pulsar build`` does. "simplify s" is the simplifier alone (median of
``--repeat`` runs after a warm-up); "frontend s" is load + shape fixing + simplifier + passes +
checks. Nodes read original -> after the simplifier -> after pulsar's passes. The deviations are
max|model - original| / max|original| over all outputs and ``--n`` real inputs, for the simplifier's
output ("dev simplified") and the final graph ("max dev"):

- det: PP-OCRv4 detector, 640x640 photo crops with rendered text lines pasted on (BGR, mean /
  std 0.5), so the probability map has text to find;
- rec: PP-OCRv4 recognizer, rendered text lines (PaddleOCR's preprocessing, 48x320);
- cls: PP-OCR direction classifier, rendered text lines, every other one turned 180 degrees
  (its 48x192 input is a text line, not a photo);
- mbv2: MobileNetV2, photo crops with the ImageNet eval transform;
- encoder: a 2-layer transformer encoder (examples/transformer.py), random tokens.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.resources
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from examples import assets
from pulsar.frontend.loader import apply_input_shapes, load_model
from pulsar.frontend.pass_manager import compare_models, optimize
from pulsar.frontend.report import frontend_report_rows, human_count, summarize
from pulsar.frontend.simplify import SIMPLIFIERS, simplify

SEED = 7
N_CHECK = 2  # inputs the transformation check runs per changed pass
NONE = "none"  # no simplifier: pulsar's passes alone


@dataclass
class Spec:
    name: str
    title: str
    model: Callable[[Path], Path]  # work dir -> float model file
    shape: list[int]  # NCHW / NLD the single input is pinned to
    inputs: Callable[[int, list[int]], list[np.ndarray]]  # n, shape -> real inputs


SPECS: dict[str, Spec] = {}


def register(spec: Spec) -> Spec:
    SPECS[spec.name] = spec
    return spec


# ---------------------------------------------------------------------------------------------------
# Models and their inputs
# ---------------------------------------------------------------------------------------------------


def _rapidocr(name: str) -> Callable[[Path], Path]:
    def locate(_work: Path) -> Path:
        path = Path(str(importlib.resources.files("rapidocr_onnxruntime") / "models" / name))
        if not path.is_file():
            raise FileNotFoundError(f"{name} is not shipped with the installed rapidocr-onnxruntime")
        return path

    return locate


def _ocr_normalize(bgr: np.ndarray) -> np.ndarray:
    """PaddleOCR: BGR, x / 255, mean 0.5, std 0.5, NCHW float32."""
    arr = (np.asarray(bgr, dtype=np.float32) / 255.0 - 0.5) / 0.5
    return np.ascontiguousarray(arr.transpose(2, 0, 1)[None])


def _det_inputs(n: int, shape: list[int]) -> list[np.ndarray]:
    """Photo crops (BGR) with 3-6 rendered text lines pasted at random places and sizes."""
    size = shape[2]
    rng = np.random.default_rng(SEED)
    lines = assets.render_text_lines(6 * n, SEED)
    out = []
    for i, crop in enumerate(assets.photo_crops(n, SEED, size=size, photos=assets.OBJECT_PHOTOS)):
        canvas = Image.fromarray(np.ascontiguousarray(crop[:, :, ::-1]))  # RGB -> BGR channel order
        for img, _text in lines[6 * i : 6 * i + int(rng.integers(3, 7))]:
            line = Image.fromarray(img)
            scale = rng.uniform(0.6, 1.4)
            line = line.resize((max(1, int(line.width * scale)), max(1, int(line.height * scale))))
            if line.width >= size or line.height >= size:
                continue
            x, y = int(rng.integers(0, size - line.width)), int(rng.integers(0, size - line.height))
            canvas.paste(line, (x, y))
        out.append(_ocr_normalize(np.asarray(canvas)))
    return out


def _rec_inputs(n: int, _shape: list[int]) -> list[np.ndarray]:
    return [assets.ocr_preprocess(img) for img, _text in assets.render_text_lines(n, SEED)]


def _cls_inputs(n: int, shape: list[int]) -> list[np.ndarray]:
    """PaddleOCR's classifier input: height 48 keeping aspect, width <= 192, right zero pad."""
    h, w = shape[2], shape[3]
    out = []
    for i, (img, _text) in enumerate(assets.render_text_lines(n, SEED + 1)):
        if i % 2:
            img = np.ascontiguousarray(img[::-1, ::-1])  # upside down: the class it must detect
        new_w = max(1, min(w, math.ceil(h * img.shape[1] / img.shape[0])))
        resized = np.asarray(Image.fromarray(img).resize((new_w, h), Image.BILINEAR))
        arr = np.zeros(shape, dtype=np.float32)
        arr[..., :new_w] = _ocr_normalize(resized)
        out.append(arr)
    return out


def _mbv2_inputs(n: int, _shape: list[int]) -> list[np.ndarray]:
    crops = assets.photo_crops(n, SEED, size=256, photos=assets.OBJECT_PHOTOS)
    return [assets.imagenet_preprocess(c) for c in crops]


def _random_inputs(n: int, shape: list[int]) -> list[np.ndarray]:
    rng = np.random.default_rng(SEED)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(n)]


def _encoder_model(work: Path) -> Path:
    from examples.transformer import transformer_encoder_onnx

    return transformer_encoder_onnx(work / "encoder.onnx")


register(
    Spec("det", "PP-OCRv4 detector", _rapidocr("ch_PP-OCRv4_det_infer.onnx"), [1, 3, 640, 640], _det_inputs)
)
register(
    Spec("rec", "PP-OCRv4 recognizer", _rapidocr("ch_PP-OCRv4_rec_infer.onnx"), [1, 3, 48, 320], _rec_inputs)
)
register(
    Spec(
        "cls",
        "PP-OCR direction cls",
        _rapidocr("ch_ppocr_mobile_v2.0_cls_infer.onnx"),
        [1, 3, 48, 192],
        _cls_inputs,
    )
)
register(
    Spec(
        "mbv2",
        "MobileNetV2",
        lambda w: assets.mobilenet_v2_onnx(w / "mbv2.onnx"),
        [1, 3, 224, 224],
        _mbv2_inputs,
    )
)
register(Spec("encoder", "transformer encoder", _encoder_model, [1, 16, 64], _random_inputs))


# ---------------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------------


@dataclass
class Result:
    model: str
    simplifier: str = NONE
    seconds: float = 0.0
    check_seconds: float = 0.0
    simplify_seconds: float = float("nan")
    nodes_before: int = 0
    nodes_simplified: int = 0
    nodes_after: int = 0
    params: int = 0
    macs: int = 0
    passes: list[str] = field(default_factory=list)
    simplified_dev: float = float("nan")
    max_dev: float = float("nan")
    note: str = ""
    ops: list[tuple[str, str, str]] = field(default_factory=list)


def _median_seconds(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up: imports and first-call set-up are not what a build pays per model
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def bench_model(spec: Spec, work: Path, n: int, simplifier: str = NONE, repeat: int = 3) -> Result:
    result = Result(spec.title, simplifier)
    try:
        path = spec.model(work)
    except FileNotFoundError as exc:
        result.note = f"not available: {exc}"
        return result
    data = spec.inputs(n, spec.shape)
    start = time.perf_counter()
    original = load_model(path)
    name = original.graph.input[0].name
    original = apply_input_shapes(original, {name: spec.shape})
    samples = [{name: x} for x in data]
    model = original
    if simplifier != NONE:
        simplified = simplify(original, simplifier, model_name=path.name, samples=samples[:N_CHECK])
        if simplified.fallback:
            result.note = f"fell back: {simplified.fallback}"
        model = simplified.model
    optimized, records = optimize(model, check=True, samples=samples[:N_CHECK])
    result.seconds = time.perf_counter() - start
    result.check_seconds = sum(r.check_seconds for r in records)
    before, after = summarize(original), summarize(optimized)
    result.nodes_before, result.nodes_after = before.nodes, after.nodes
    result.nodes_simplified = len(model.graph.node)
    result.params, result.macs = after.params, after.macs
    result.passes = [r.name for r in records if r.changed_iterations]
    result.max_dev = max(row["rel_diff"] for row in compare_models(original, optimized, samples))
    if simplifier != NONE:
        result.simplified_dev = max(row["rel_diff"] for row in compare_models(original, model, samples))
        result.simplify_seconds = _median_seconds(lambda: simplify(original, simplifier, check=False), repeat)
    result.ops = frontend_report_rows(before, after)
    return result


def format_table(results: list[Result], n: int) -> str:
    head = [
        "model",
        "simplifier",
        "simplify s",
        "frontend s",
        "(check s)",
        "nodes",
        "params",
        "MACs",
        f"dev simplified ({n} inputs)",
        "max dev",
        "passes fired",
    ]
    body = []
    for r in results:
        if r.note.startswith("not available"):
            body.append([r.model, r.simplifier, *["-"] * 8, r.note])
            continue
        simplified = r.simplifier != NONE
        nodes = f"{r.nodes_before} -> {r.nodes_simplified} -> {r.nodes_after}" if simplified \
            else f"{r.nodes_before} -> {r.nodes_after}"
        body.append([
            r.model,
            r.simplifier,
            f"{r.simplify_seconds:.2f}" if simplified else "-",
            f"{r.seconds:.2f}",
            f"{r.check_seconds:.2f}",
            nodes,
            human_count(r.params),
            human_count(r.macs),
            f"{r.simplified_dev:.2g}" if simplified else "-",
            f"{r.max_dev:.2g}",
            ", ".join(r.passes) + (f" [{r.note}]" if r.note else ""),
        ])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=True)]
    lines = []
    for i, cells in enumerate([head, *body]):
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_ops(result: Result) -> str:
    width = max(len(label) for label, _, _ in result.ops)
    lines = [f"{result.model} ({result.simplifier}): op counts before -> after"]
    lines += [f"  {label.ljust(width)}  {b:>8} -> {a}" for label, b, a in result.ops]
    return "\n".join(lines)


def import_seconds(module: str, repeat: int) -> float:
    """Median time to import ``module`` in a fresh interpreter that already has numpy / onnx /
    onnxruntime (as a pulsar build has): paid once per process, on top of "simplify s"."""
    code = f"import time, numpy, onnx, onnxruntime; t = time.perf_counter(); import {module}; " \
        "print(time.perf_counter() - t)"
    runs = [float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
            for _ in range(repeat)]
    return sorted(runs)[len(runs) // 2]


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="pulsar frontend on real models")
    parser.add_argument("--models", type=_csv, default=list(SPECS), help=f"comma list of {', '.join(SPECS)}")
    parser.add_argument(
        "--simplifiers",
        type=_csv,
        default=[NONE, *SIMPLIFIERS],
        help=f"comma list of {', '.join([NONE, *SIMPLIFIERS])} (onnx_opt.simplifier; none = passes alone)",
    )
    parser.add_argument("--n", type=int, default=4, help="real inputs per model for the deviation figure")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per simplifier (median)")
    parser.add_argument("--ops", action="store_true", help="also print each model's op counts before / after")
    parser.add_argument(
        "--work-dir", type=Path, help="keep exported models here (default: a temporary folder)"
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    unknown = [m for m in args.models if m not in SPECS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {list(SPECS)}")
    bad = [t for t in args.simplifiers if t != NONE and t not in SIMPLIFIERS]
    if bad:
        parser.error(f"unknown simplifier(s) {bad}; choose from {[NONE, *SIMPLIFIERS]}")
    if args.n < 1 or args.repeat < 1:
        parser.error("--n and --repeat must be at least 1")

    for tool in args.simplifiers:  # imports are measured on their own (below), not as frontend time
        if tool != NONE:
            importlib.import_module(tool)
    results = []
    with tempfile.TemporaryDirectory(prefix="pulsar-bench-") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in args.models:
            for tool in args.simplifiers:
                print(f"== {SPECS[name].title} ({tool})", file=sys.stderr, flush=True)
                results.append(bench_model(SPECS[name], work, args.n, tool, args.repeat))
    print(format_table(results, args.n), flush=True)
    imports = {t: import_seconds(t, args.repeat) for t in args.simplifiers if t != NONE}
    if imports:
        print("\nimport s (fresh interpreter, once per process, not in the table): "
              + ", ".join(f"{t} {sec:.2f}" for t, sec in imports.items()))
    if args.ops:
        for r in results:
            if r.ops:
                print("\n" + format_ops(r))
    if args.json:
        args.json.write_text(json.dumps({"results": [asdict(r) for r in results], "import_seconds": imports},
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
