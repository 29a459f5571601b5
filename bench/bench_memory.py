"""Peak memory and time of `pulsar build` against the calibration set size.

python -m bench.bench_memory [--models ocr,mbv2] [--sizes 32,256]

Calibration streams its data and keeps fixed-size statistics per tensor, so peak memory should not
grow with `calibration_size`. Each build runs in its own process (fresh work dir, no statistics
cache) and its peak resident set size is read from the OS.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from examples.assets import IMAGENET_MEAN, IMAGENET_STD, make_example_assets

_PEAK = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
         "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def _config(model: str, paths: dict[str, Path], size: int) -> tuple[Path, dict]:
    if model == "ocr":
        return paths["ocr_rec"], {"input_shapes": "x:1x3x48x320", "quant": {"input_configs": [
            {"tensor_name": "x", "calibration_dataset": str(paths["ocr_calib"]), "calibration_format": "Numpy",
             "calibration_size": size}]}}
    return paths["mobilenetv2"], {"quant": {"input_configs": [
        {"tensor_name": "DEFAULT", "calibration_dataset": str(paths["imagenet_calib"]), "calibration_size": size,
         "calibration_mean": list(IMAGENET_MEAN), "calibration_std": list(IMAGENET_STD)}]},
        "input_processors": [{"tensor_name": "DEFAULT", "tensor_format": "RGB"}]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="ocr,mbv2")
    parser.add_argument("--sizes", default="32,256")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        paths = make_example_assets(root / "assets", n_calib=max(sizes))
        print(f"assets with {max(sizes)} calibration samples made in {time.perf_counter() - t0:.1f} s", flush=True)
        print(f"{'model':6s} {'calibration_size':>16s} {'peak RSS MB':>12s} {'build s':>8s}")
        for model in args.models.split(","):
            peaks = {}
            for size in sizes:
                onnx_path, cfg = _config(model, paths, size)
                cfg_path = root / f"{model}_{size}.json"
                cfg_path.write_text(json.dumps(cfg))
                cmd = [sys.executable, "-m", "pulsar", "build", "--input", str(onnx_path), "--config", str(cfg_path),
                       "--output_dir", str(root / f"out_{model}_{size}"), "--quiet"]
                t0 = time.perf_counter()
                out = subprocess.run([sys.executable, "-c", _PEAK, *cmd], capture_output=True, text=True, check=True)
                peaks[size] = int(out.stdout.strip().splitlines()[-1]) / 1024
                print(f"{model:6s} {size:16d} {peaks[size]:12.0f} {time.perf_counter() - t0:8.1f}", flush=True)
            print(f"{model:6s} peak ratio {max(sizes)} / {min(sizes)}: {peaks[max(sizes)] / peaks[min(sizes)]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
