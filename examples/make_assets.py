"""Create the README's example set: both models and their calibration data, from installed packages.

python examples/make_assets.py [--out examples/assets] [--n-calib 32]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.assets import make_example_assets  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("examples/assets"), help="output folder")
    parser.add_argument("--n-calib", type=int, default=32, help="calibration samples per model")
    args = parser.parse_args(argv)
    if args.n_calib < 1:
        parser.error("--n-calib must be at least 1")
    start = time.perf_counter()
    paths = make_example_assets(args.out, n_calib=args.n_calib)
    for key, path in paths.items():
        count = f" ({sum(1 for _ in path.iterdir())} files)" if path.is_dir() else ""
        print(f"{key:20s} {path}{count}")
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
