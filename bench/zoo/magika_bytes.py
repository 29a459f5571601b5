"""Magika 1.0.3's content-type model ``standard_v3_3``: a byte-sequence classifier exported from
Keras / JAX with tf2onnx (opset 15 + ai.onnx.ml), LayerNorm written out in primitive ops.

Input ``bytes`` int32 [1, 2048]: magika's own feature extraction (``Magika._extract_features_from_seekable``
with the model's ``config.min.json``: the first 1024 bytes after lstrip, the last 1024 before
rstrip, padded with token 256); output ``target_label`` [1, 214] probabilities. Data: real files
of this system (CPython's Lib, /usr/share/doc, /usr/lib, /usr/include, /etc, fonts, images, man
pages, ELF binaries, ...), calibration and evaluation files disjoint (alternate files per kind).
Metric: top-1 label agreement with float (and the mean probability of float's label).
"""

from __future__ import annotations

import functools
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np

from bench.zoo import Feed, Runner, fix_input_shapes, package_file
from bench.zoo._data import Part

TITLE = "Magika content-type classifier"
PACKAGE = "magika==1.0.3"
WHEEL_FILE = "magika/models/standard_v3_3/model.onnx"
METRIC = "top-1 label agreement with float on real system files"
KEYS = ("top1_agree", "p_float_label")

# (folder, glob): files of many kinds that every Debian / CPython install has
SOURCES = (
    (sysconfig.get_paths()["stdlib"], "*.py"), (sysconfig.get_paths()["stdlib"], "*/*.py"),
    ("/usr/share/doc", "*/copyright"), ("/usr/share/doc", "*/changelog*.gz"), ("/usr/share/man", "man1/*.gz"),
    ("/usr/lib/x86_64-linux-gnu", "*.so*"), ("/usr/include", "*.h"), ("/usr/bin", "*"), ("/etc", "*.conf"),
    ("/usr/share/zoneinfo", "*/*"), ("/usr/share/mime", "packages/*.xml"), ("/etc", "*/*"),
    (sysconfig.get_paths()["purelib"], "*/*.json"), (sysconfig.get_paths()["purelib"], "*/*.pyi"),
    (sysconfig.get_paths()["purelib"], "*/*.txt"), (sysconfig.get_paths()["purelib"], "*/*/*.png"),
    (sysconfig.get_paths()["purelib"], "*/*/*.jpg"), (sysconfig.get_paths()["purelib"], "*/*/*/*.ttf"),
    (sysconfig.get_paths()["purelib"], "*/*/*.csv"), (sysconfig.get_paths()["purelib"], "*/*/*.html"),
    (sysconfig.get_paths()["purelib"], "*/*/*.npz"), (sysconfig.get_paths()["purelib"], "*/*.so"),
    (sysconfig.get_paths()["purelib"], "*/*/*.gz"), (sysconfig.get_paths()["purelib"], "*/*/*.svg"),
    (sysconfig.get_paths()["purelib"], "*/*/*.js"), (sysconfig.get_paths()["purelib"], "*/*/*.css"),
    (sysconfig.get_paths()["purelib"], "*/*/*.c"), (sysconfig.get_paths()["purelib"], "*/*/*.toml"),
    (sysconfig.get_paths()["purelib"], "*/*/*.yaml"), (sysconfig.get_paths()["purelib"], "*/*/*.onnx"),
    (sys.prefix, "bin/*"),
)
PER_SOURCE = 24  # at most this many files of each (folder, glob), half to each part


def float_model(cache: Path) -> Path:
    return fix_input_shapes(package_file("magika", "models/standard_v3_3/model.onnx", PACKAGE),
                            cache / "magika_standard_v3_3.onnx", {"bytes": [1, 2048]})


@functools.cache
def _config() -> dict:
    return json.loads(package_file("magika", "models/standard_v3_3/config.min.json", PACKAGE).read_text())


@functools.cache
def files(part: Part) -> tuple[Path, ...]:
    """Readable regular files, at most PER_SOURCE per source, alternately to calibration and evaluation."""
    rng = np.random.default_rng(3)
    out: list[Path] = []
    for folder, pattern in SOURCES:
        found = sorted(p for p in Path(folder).glob(pattern)
                       if p.is_file() and not p.is_symlink() and p.stat().st_size >= 8)
        if len(found) > PER_SOURCE:
            found = [found[i] for i in sorted(rng.choice(len(found), PER_SOURCE, replace=False))]
        out.extend(found[0 if part == "calib" else 1 :: 2])
    order = rng.permutation(len(out))
    return tuple(out[i] for i in order)


def features(path: Path) -> np.ndarray:
    """magika's own features of one file: int32 [1, 2048] (beg + end)."""
    from magika.magika import Magika
    from magika.types.seekable import Seekable

    cfg = _config()
    with path.open("rb") as stream:
        f = Magika._extract_features_from_seekable(
            Seekable(stream), beg_size=cfg["beg_size"], mid_size=cfg["mid_size"], end_size=cfg["end_size"],
            padding_token=cfg["padding_token"], block_size=cfg["block_size"],
            use_inputs_at_offsets=cfg["use_inputs_at_offsets"])
    return np.asarray([f.beg[: cfg["beg_size"]] + f.end[-cfg["end_size"] :]], np.int32)


def calib_feeds(n: int, model: Path) -> list[Feed]:
    return [{"bytes": features(p)} for p in files("calib")[:n]]


def eval_items(n: int, model: Path) -> list[Path]:
    return list(files("eval")[:n])


def predict(run: Runner, items: list[Path]) -> list[np.ndarray]:
    return [run({"bytes": features(p)})["target_label"][0] for p in items]


def score(pred: list[np.ndarray], ref: list[np.ndarray]) -> dict[str, float]:
    top = [int(r.argmax()) for r in ref]
    return {"top1_agree": float(np.mean([int(p.argmax()) == t for p, t in zip(pred, top, strict=True)])),
            "p_float_label": float(np.mean([p[t] for p, t in zip(pred, top, strict=True)]))}
