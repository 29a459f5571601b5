"""Create the README's example set: both models, their calibration data and samples for `pulsar run`,
from installed packages.

python examples/make_assets.py [--out examples/assets] [--n-calib 32] [--n-samples 4]

The run samples are photos in the compiled MobileNetV2's deployed input format (configs/mobilenetv2.json's
input_processors: uint8 RGB pixels, NHWC, 1x224x224x3; normalization and layout change run inside the
model): ``<out>/samples/<photo>/input.npy``, listed one directory a line in ``<out>/samples.txt``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.assets import OBJECT_PHOTOS, load_photo, make_example_assets, photo_names  # noqa: E402

SAMPLE_INPUT = "input"  # the model's input tensor: file input.npy (pulsar run names files after tensors)
SAMPLE_SIZE = 224


def deployed_pixels(img_rgb: np.ndarray, size: int = SAMPLE_SIZE) -> np.ndarray:
    """What a camera pipeline hands the compiled model: short side resized to 256/224 of ``size``,
    center crop ``size`` x ``size``, uint8 RGB, NHWC with a batch of 1."""
    from PIL import Image

    img = Image.fromarray(np.ascontiguousarray(img_rgb))
    w, h = img.size
    scale = round(size * 256 / 224) / min(w, h)
    img = img.resize((max(size, round(w * scale)), max(size, round(h * scale))), Image.BILINEAR)
    w, h = img.size
    left, top = (w - size) // 2, (h - size) // 2
    pixels = np.asarray(img.crop((left, top, left + size, top + size)), dtype=np.uint8)
    return np.ascontiguousarray(pixels[None])


def write_run_samples(out: Path, n: int) -> tuple[Path, Path]:
    """``n`` photo samples under ``out/samples`` and the list file ``out/samples.txt``; stale sample
    directories from an earlier (larger) run are removed so the list and the folder agree."""
    from pulsar.utils.atomic import atomic_save_npy, atomic_write_text

    available = set(photo_names())
    names = [p for p in OBJECT_PHOTOS if p in available][:n]
    root = out / "samples"
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.iterdir():
        if stale.is_dir() and stale.name not in names and (stale / f"{SAMPLE_INPUT}.npy").is_file():
            (stale / f"{SAMPLE_INPUT}.npy").unlink()
            if not any(stale.iterdir()):
                stale.rmdir()
    for name in names:
        atomic_save_npy(root / name / f"{SAMPLE_INPUT}.npy", deployed_pixels(load_photo(name)))
    listing = out / "samples.txt"
    atomic_write_text(listing, "# one sample directory a line, relative to --input_dir\n" + "\n".join(names) + "\n")
    return root, listing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("examples/assets"), help="output folder")
    parser.add_argument("--n-calib", type=int, default=32, help="calibration samples per model")
    parser.add_argument("--n-samples", type=int, default=4, help="photo samples for `pulsar run`")
    args = parser.parse_args(argv)
    if args.n_calib < 1:
        parser.error("--n-calib must be at least 1")
    if args.n_samples < 1:
        parser.error("--n-samples must be at least 1")
    start = time.perf_counter()
    paths = make_example_assets(args.out, n_calib=args.n_calib)
    paths["run_samples"], paths["run_list"] = write_run_samples(args.out, args.n_samples)
    for key, path in paths.items():
        count = f" ({sum(1 for p in path.rglob('*') if p.is_file())} files)" if path.is_dir() else ""
        print(f"{key:20s} {path}{count}")
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
