"""Multi-batch and extra input shapes on MobileNetV2: bit-exactness, size, accuracy, simulator throughput.

    python -m bench.bench_variants [--n 200] [--timing-n 64] [--work-dir DIR]

Builds MobileNetV2 from the offline example assets (the ``mbv2`` spec of bench/bench_quant.py,
whose compiled model takes preprocessed float NCHW tensors) four ways and prints:

1. ``static_batch_sizes [1, 2, 4]``: the compiled file size against the batch-1 build, and whether
   ``run_batches`` of 3 and 9 samples (2 + 1, 4 + 4 + 1) equals 3 and 9 single-sample runs exactly.
2. ``src_extra_shapes`` 256x256 and 192x160: per shape group, the top-1 agreement of the compiled
   model (NPUBackend) with the float model evaluated at the same resolution on ``--n`` photo crops;
   and whether group 1 equals, bit for bit, a separate build of the *same* QDQ model re-shaped to
   256x256 (``model_type QuantONNX``: the quantization parameters are reused).
3. Throughput: ``static_batch_sizes [1, 4, 8]``: images / s of the NPUBackend simulator running
   batches of 1, 4 and 8 over ``--timing-n`` images, next to onnxruntime running the float model at
   the same batch (same thread count), and their ratio. Timings are wall clock, best of
   ``--repeat`` passes, the two runners' passes alternating (plus the median ratio of each round's
   pair, which load from other processes disturbs least); run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from bench.bench_quant import SPECS
from examples import assets

N_CALIB = 32
SEED = 1234


def _build(float_model: Path, config: dict, out: Path, quiet: bool = True) -> Path:
    import pulsar

    return Path(pulsar.build(input=str(float_model), output_dir=str(out), config=config, quiet=quiet).compiled_model)


def _with_input_dims(model: onnx.ModelProto, dims: list[int | str]) -> onnx.ModelProto:
    """``model`` with its (single) input's dims replaced and the derived shapes dropped."""
    m = copy.deepcopy(model)
    shape = m.graph.input[0].type.tensor_type.shape
    shape.Clear()
    for d in dims:
        if isinstance(d, str):
            shape.dim.add().dim_param = d
        else:
            shape.dim.add().dim_value = d
    del m.graph.value_info[:]
    for out in m.graph.output:  # left to inference: named (free) dims
        for k, d in enumerate(out.type.tensor_type.shape.dim):
            d.dim_param = f"{out.name}_d{k}"
    return m


def _ort(model: onnx.ModelProto, threads: int) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _crops(n: int, h: int, w: int) -> np.ndarray:
    """``n`` photo crops at ``h`` x ``w``, ImageNet-normalized NCHW float32."""
    from PIL import Image

    size = max(h, w)
    out = []
    for c in assets.photo_crops(n, SEED, size=size, part="eval", photos=assets.OBJECT_PHOTOS):
        img = np.asarray(Image.fromarray(c).resize((w, h), Image.BILINEAR), np.float32)
        img = (img - np.array(assets.IMAGENET_MEAN, np.float32)) / np.array(assets.IMAGENET_STD, np.float32)
        out.append(img.transpose(2, 0, 1)[None])
    return np.concatenate(out).astype(np.float32)


def static_batches(float_model: Path, config: dict, work: Path, single: Path) -> dict:
    import pulsar

    cfg = {**config, "compiler": {"static_batch_sizes": [1, 2, 4]}}
    compiled = _build(float_model, cfg, work / "static_124")
    sess = pulsar.Session(compiled)
    name = sess.inputs[0].name
    x = _crops(9, 224, 224)
    singles = np.concatenate([next(iter(sess.run({name: x[i:i + 1]}).values())) for i in range(9)])
    exact = {}
    for n in (3, 9):
        got = next(iter(sess.run_batches({name: x[:n]}, n).values()))
        exact[n] = {"plan": sess.batch_plan(n), "bit_exact": bool(np.array_equal(got, singles[:n]))}
    return {"size_bytes": compiled.stat().st_size, "batch1_size_bytes": single.stat().st_size,
            "size_ratio": compiled.stat().st_size / single.stat().st_size, "runs": exact}


def extra_shapes(float_model: Path, config: dict, work: Path, n: int, threads: int) -> dict:
    import pulsar

    shapes = [(224, 224), (256, 256), (192, 160)]
    procs = [{**p, "src_extra_shapes": [{"shape": [1, 3, h, w]} for h, w in shapes[1:]]}
             for p in config["input_processors"]]
    out_dir = work / "extra"
    compiled = _build(float_model, {**config, "input_processors": procs}, out_dir)
    fmodel = onnx.load(str(float_model))
    groups = []
    for g, (h, w) in enumerate(shapes):
        x = _crops(n, h, w)
        ref = _ort(_with_input_dims(fmodel, [1, 3, h, w]), threads)
        sess = pulsar.Session(compiled, group=g)
        name, ref_name = sess.inputs[0].name, ref.get_inputs()[0].name
        agree = 0
        for i in range(n):
            want = ref.run(None, {ref_name: x[i:i + 1]})[0]
            got = next(iter(sess.run({name: x[i:i + 1]}).values()))
            agree += int(np.argmax(want) == np.argmax(got))
        groups.append({"group": g, "shape": [h, w], "top1_agreement": agree / n})
    # the same QDQ model at 256x256, built on its own: the quantization parameters are reused as they are
    qdq = _with_input_dims(onnx.load(str(out_dir / "quant" / "quantized.onnx")), [1, 3, 256, 256])
    qdq_path = work / "quantized_256.onnx"
    onnx.save(qdq, str(qdq_path))
    separate = _build(qdq_path, {**config, "model_type": "QuantONNX"},
                      work / "separate_256")
    x = _crops(8, 256, 256)
    a, b = pulsar.Session(compiled, group=1), pulsar.Session(separate)
    same = all(np.array_equal(next(iter(a.run({a.inputs[0].name: x[i:i + 1]}).values())),
                              next(iter(b.run({b.inputs[0].name: x[i:i + 1]}).values()))) for i in range(len(x)))
    return {"groups": groups, "group1_equals_separate_build": bool(same),
            "agreement_gap_points": 100 * (groups[0]["top1_agreement"] - groups[1]["top1_agreement"])}


def _pass(fn, chunks: list[np.ndarray]) -> float:
    t0 = time.perf_counter()
    for c in chunks:
        fn(c)
    return time.perf_counter() - t0


def _paired(npu, flt, chunks: list[np.ndarray], repeat: int) -> tuple[float, float, float]:
    """Images / s of each runner (best pass) and the median per-round ratio: the passes alternate, so
    a burst of load from elsewhere hits both runners of a round alike."""
    npu(chunks[0])
    flt(chunks[0])
    images = sum(len(c) for c in chunks)
    rounds = [(_pass(npu, chunks), _pass(flt, chunks)) for _ in range(repeat)]
    ratio = float(np.median([f / n for n, f in rounds]))
    return images / min(n for n, _ in rounds), images / min(f for _, f in rounds), ratio


def throughput(float_model: Path, config: dict, work: Path, n: int, threads: int, repeat: int) -> list[dict]:
    import pulsar

    compiled = _build(float_model, {**config, "compiler": {"static_batch_sizes": [1, 4, 8]}}, work / "static_148")
    sess = pulsar.Session(compiled, workers=1)
    name = sess.inputs[0].name
    ref = _ort(_with_input_dims(onnx.load(str(float_model)), ["N", 3, 224, 224]), threads)
    ref_name = ref.get_inputs()[0].name
    x = _crops(n, 224, 224)
    rows = []
    for batch in (1, 4, 8):
        chunks = [x[i:i + batch] for i in range(0, n - n % batch, batch)]
        npu, flt, paired = _paired(lambda c: sess.run({name: c}), lambda c: ref.run(None, {ref_name: c}), chunks,
                                   repeat)
        rows.append({"batch": batch, "npubackend_ips": npu, "ort_float_ips": flt, "ratio": npu / flt,
                     "median_round_ratio": paired})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="pulsar multi-batch and extra shapes on MobileNetV2")
    parser.add_argument("--n", type=int, default=200, help="photo crops per shape group (accuracy)")
    parser.add_argument("--timing-n", type=int, default=64, help="images per timed pass")
    parser.add_argument("--threads", type=int, default=1, help="torch and onnxruntime intra-op threads")
    parser.add_argument("--repeat", type=int, default=3, help="timed passes (the fastest is kept)")
    parser.add_argument("--work-dir", type=Path, help="keep the assets and builds here (default: temporary)")
    parser.add_argument("--skip", default="", help="comma list of parts to skip: static, extra, speed")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    ort.set_default_logger_severity(3)
    skip = set(filter(None, args.skip.split(",")))
    result: dict = {}
    with tempfile.TemporaryDirectory(prefix="pulsar-bench-variants-") as tmp:
        work = args.work_dir or Path(tmp)
        paths = assets.make_example_assets(work / "assets", n_calib=N_CALIB)
        float_model, config = SPECS["mbv2"].prepare(paths)
        print("building MobileNetV2 ...", file=sys.stderr, flush=True)
        single = _build(float_model, config, work / "single")
        if "static" not in skip:
            result["static"] = s = static_batches(float_model, config, work, single)
            print(f"static_batch_sizes [1, 2, 4]: {s['size_bytes']:,} bytes, {s['size_ratio']:.3f}x the batch-1 "
                  f"build ({s['batch1_size_bytes']:,})")
            for n, r in s["runs"].items():
                print(f"  {n} samples as {r['plan']}: {'bit-exact' if r['bit_exact'] else 'DIFFERENT'} vs {n} "
                      "single-sample runs")
        if "extra" not in skip:
            result["extra"] = e = extra_shapes(float_model, config, work, args.n, args.threads)
            print(f"src_extra_shapes ({args.n} crops per group): top-1 agreement with the float model at the same "
                  "resolution")
            for g in e["groups"]:
                print(f"  group {g['group']} {g['shape'][0]}x{g['shape'][1]}: {g['top1_agreement']:.3f}")
            print(f"  group 0 - group 1: {e['agreement_gap_points']:+.1f} points; group 1 equals a separate build "
                  f"of the same QDQ model at 256x256: {e['group1_equals_separate_build']}")
        if "speed" not in skip:
            result["speed"] = rows = throughput(float_model, config, work, args.timing_n, args.threads, args.repeat)
            print(f"throughput, {args.threads} thread(s), images/s (wall, best of {args.repeat}):")
            print(f"  {'batch':>5}{'NPUBackend':>12}{'ORT float':>12}{'ratio':>8}{'median round ratio':>20}")
            for r in rows:
                print(f"  {r['batch']:>5}{r['npubackend_ips']:>12.1f}{r['ort_float_ips']:>12.1f}{r['ratio']:>8.3f}"
                      f"{r['median_round_ratio']:>20.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
