"""Calibration's float pass + statistics: onnxruntime on CPU against torch on ``--device`` (``quant.device``).

    python bench/bench_calibration_device.py [--model PATH.onnx] [--channels 64] [--blocks 6]
        [--size 160] [--batch 1] [--samples 32] [--device cuda:0] [--torch-cpu] [--bins 4096]

Without ``--model`` it generates a residual conv net (``--blocks`` blocks of Conv3x3-Relu-Conv3x3-Add-Relu,
``--channels`` wide, input ``batch x 3 x size x size``). Every float activation is calibrated, as a
build does (:func:`pulsar.quant.stage.calibration_tensors`); the samples are random normal data.
It prints samples/s of ``collect_statistics`` on ``cpu`` (onnxruntime) and on ``--device`` (the torch
pass, statistics reduced on the device; one warm-up sample first, not timed), and, per calibration
method, the largest difference of a tensor's range from the onnxruntime one, relative to its width. Without a GPU it runs
only CPU paths (``--torch-cpu`` adds the torch pass on CPU). Needs torch, onnx, onnxruntime, numpy and
the pulsar package (the repository root is put on sys.path).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import torch  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from pulsar.quant.calibrate import collect_statistics, compute_ranges  # noqa: E402
from pulsar.quant.observers import TensorStats  # noqa: E402
from pulsar.quant.stage import calibration_tensors  # noqa: E402

METHODS = ("MinMax", "Percentile", "MSE", "KL")


def conv_net(channels: int, blocks: int, size: int, batch: int) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []

    def conv(x: str, cin: int, cout: int, name: str) -> str:
        w = rng.normal(0, (2.0 / (9 * cin)) ** 0.5, (cout, cin, 3, 3)).astype(np.float32)
        inits.extend([numpy_helper.from_array(w, f"{name}.w"),
                      numpy_helper.from_array(rng.normal(0, 0.05, cout).astype(np.float32), f"{name}.b")])
        nodes.append(helper.make_node("Conv", [x, f"{name}.w", f"{name}.b"], [name], pads=[1, 1, 1, 1]))
        return name

    x = conv("input", 3, channels, "stem")
    nodes.append(helper.make_node("Relu", [x], ["stem_r"]))
    x = "stem_r"
    for b in range(blocks):
        y = conv(x, channels, channels, f"b{b}.c1")
        nodes.append(helper.make_node("Relu", [y], [f"b{b}.r1"]))
        y = conv(f"b{b}.r1", channels, channels, f"b{b}.c2")
        nodes.append(helper.make_node("Add", [y, x], [f"b{b}.add"]))
        nodes.append(helper.make_node("Relu", [f"b{b}.add"], [f"b{b}.out"]))
        x = f"b{b}.out"
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["pool"]))
    graph = helper.make_graph(nodes, "bench_conv", [helper.make_tensor_value_info("input", TensorProto.FLOAT,
                                                                                  [batch, 3, size, size])],
                              [helper.make_tensor_value_info("pool", TensorProto.FLOAT, [batch, channels, 1, 1])],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def random_samples(model: onnx.ModelProto, n: int) -> list[dict[str, np.ndarray]]:
    inits = {t.name for t in model.graph.initializer}
    rng = np.random.default_rng(1)
    out: list[dict[str, np.ndarray]] = []
    for _ in range(n):
        sample = {}
        for vi in model.graph.input:
            if vi.name in inits:
                continue
            shape = [d.dim_value if d.HasField("dim_value") else 1 for d in vi.type.tensor_type.shape.dim]
            dtype = helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
            sample[vi.name] = (rng.normal(0, 1, shape) if dtype.kind == "f" else np.zeros(shape)).astype(dtype)
        out.append(sample)
    return out


def timed(model: onnx.ModelProto, names: list[str], samples: list[dict[str, np.ndarray]], bins: int,
          **kw: str) -> tuple[dict[str, TensorStats], float]:
    if kw.get("device", "cpu") != "cpu" or kw.get("backend") == "torch":
        collect_statistics(model, names, samples[:1], num_bins=bins, **kw)  # warm-up: CUDA context, kernels
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    start = time.perf_counter()
    stats = collect_statistics(model, names, samples, num_bins=bins, **kw)
    return stats, len(samples) / (time.perf_counter() - start)


def range_difference(a: dict[str, TensorStats], b: dict[str, TensorStats], method: str) -> tuple[float, str]:
    """Largest |range a - range b| / (range b's width) over the tensors, and where."""
    worst, where = 0.0, ""
    ra, rb = compute_ranges(a, method), compute_ranges(b, method)
    for name, (lo, hi) in rb.items():
        d = max(abs(ra[name][0] - lo), abs(ra[name][1] - hi)) / max(hi - lo, 1e-12)
        if d >= worst:
            worst, where = d, name
    return worst, where


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, help="an ONNX model (default: a generated conv net)")
    ap.add_argument("--channels", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--size", type=int, default=160)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--torch-cpu", action="store_true", help="also time the torch pass on CPU")
    ap.add_argument("--bins", type=int, default=4096)
    args = ap.parse_args()

    model = onnx.load(args.model) if args.model else conv_net(args.channels, args.blocks, args.size, args.batch)
    model = onnx.shape_inference.infer_shapes(model)
    names = calibration_tensors(model)
    samples = random_samples(model, args.samples)
    what = args.model or f"conv net {args.blocks} blocks x {args.channels} ch, {args.batch}x3x{args.size}x{args.size}"
    print(f"model: {what}; {len(names)} calibrated tensors, {len(samples)} samples, {args.bins} bins, "
          f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads"
          + (f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ", no CUDA"))
    ref, rate = timed(model, names, samples, args.bins)
    print(f"{'cpu (onnxruntime)':<24} {rate:8.2f} samples/s")
    runs = [("cpu (torch)", {"backend": "torch"})] if args.torch_cpu or args.device == "cpu" else []
    if args.device != "cpu":
        runs.append((f"{args.device} (torch)", {"device": args.device}))
    for label, kw in runs:
        stats, r = timed(model, names, samples, args.bins, **kw)
        diffs = [(m, *range_difference(stats, ref, m)) for m in METHODS]
        print(f"{label:<24} {r:8.2f} samples/s  x{r / rate:.1f}  max range difference / range: "
              + ", ".join(f"{m} {d:.1e} ({w})" for m, d, w in diffs))


if __name__ == "__main__":
    main()
