"""Fine-tuning (AdaRound / BRECQ / LSQ) against the default quantization: accuracy, build time, memory.

    python -m bench.bench_finetune [--models all|bench|zoo|mbv2,ocr,cls,zoo:magika,...]
        [--algorithms default,adaround,brecq,lsq] [--epochs 100] [--block-size 4] [--eval-n N]
        [--calib-n 32] [--device cpu] [--memory] [--json FILE] [--work-dir DIR]

Models (``--models``, a comma list; default ``all``):

- bench_quant's specs (``bench.bench_quant.SPECS``): ``mbv2`` (MobileNetV2), ``ocr`` (PP-OCRv4
  recognizer), ``cls`` (PP-OCR direction classifier): the same float model, config and calibration
  samples as bench_quant;
- the zoo (``bench.zoo.MODELS``), as ``zoo:<name>`` or the plain name: ``nudenet``, ``magika``,
  ``silero_vad``, ``silero_vad_v6``, ``oww_embed``, ``ppocrv6_det``, ``minilm_hf``,
  ``orientation``, ``layout``: each zoo module's own float model, calibration feeds (written as
  bench_zoo writes them, with the module's ``CONFIG`` merged), evaluation items, ``predict`` and
  ``score`` (its metric against the float model's predictions on the same items);
- groups: ``all`` (every model above), ``bench`` (the three specs), ``zoo`` (the nine zoo models).

Evaluation sets (every one disjoint from calibration; the script checks and prints it): each spec
is scored on every set bench_quant gives it, and this script adds an other-source set where the
spec has one only. Per model, the first set is the bench's own, the second one drawn from other
sources:

- mbv2: ``photos`` (second halves of the object photos), ``other`` (other photos, other framings),
  ``third`` (scikit-image's LFW thumbnails);
- ocr: ``lines`` (evaluation words, DejaVu fonts) and ``other`` (added here: lines of a word list
  no other set uses, in Computer Modern / STIX / oblique DejaVu fonts no other set uses, sizes
  22-40, a quarter light on dark; :func:`assets.direction_lines`' ``other`` sources);
- cls: ``lines`` and ``other`` (other words, fonts, sizes, light on dark);
- zoo: ``zoo`` (the module's ``eval_items``) and ``other`` (added here, see ``ZOO_OTHER``):
  nudenet: LFW face thumbnails and other photos (microscopy, space, textures, ...); magika: system
  files of kinds / folders the zoo's sources skip (perl modules, locales, completions, dpkg lists,
  licences, certificates, deeper stdlib / site-packages files, ...); ppocrv6_det, orientation:
  pages of other-source text lines pasted on paper or on faded other photos (orientation: plus
  crops of scikit-image's scanned ``page``), turned by multiples of 90 degrees for orientation;
  minilm_hf: numpy's docstrings (summary + extended summary); silero_vad, silero_vad_v6,
  oww_embed: numpy docstring sentences spoken by espeak-ng voices the zoo does not use. layout has
  none (its page generator is fixed to the zoo's words): its ``other`` column reads ``-``.

For each model it builds, in the same run, the default config and the same config plus
``quant.enable_<algo>``, ``quant.finetune_epochs``, ``quant.finetune_block_size`` and
``quant.device``, each in a fresh output folder (so neither the calibration statistics nor the
fine-tuning cache of an earlier build is reused; a build that still loaded the fine-tuning cache
is flagged ``cached``), and prints:

- the wall-clock seconds of each whole ``pulsar.build`` (frontend, calibration, fine-tuning, compile);
- per evaluation set, the model's headline metric of the compiled model run by ``pulsar.Session``
  in ``Reference`` mode (QDQ as float math) and in the default ``NPUBackend`` mode (bit-exact integer
  simulation), each with its difference to the default row: mbv2 top-1 agreement with the float
  model, ocr exact-match rate against the rendered text, cls agreement with the float model, zoo
  models the first of the module's ``KEYS`` (vs float); the float model's own label-based scores
  are printed above the table; a second table holds every metric of every set and mode;
- per fine-tuning build, from its ``build.log``: blocks, blocks rolled back (the hard-rounded loss
  ended worse than the calibrated one), blocks with nothing to train, fine-tuning seconds;
- ocr: onnxruntime's ``quantize_static`` (MinMax, QDQ, per channel, the same calibration samples) on
  pulsar's optimized float graph, timed in the same run, its Reference-style score on every set,
  and the ratio of each fine-tuning build's seconds to it (a whole pulsar build against
  quantization alone).

``--eval-n``: evaluation samples per set (default: 200 for the specs, the zoo module's ``N_EVAL``
or 100 for zoo models). ``--calib-n``: calibration samples (default 32; a zoo module's ``N_CALIB``
caps it, e.g. layout 8).

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
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from PIL import Image

from bench import bench_quant as bq
from bench import zoo
from examples import assets

ALGORITHMS = ("default", "adaround", "brecq", "lsq")
MEMORY_SIZES = (32, 256)
N_CALIB = 32
N_EVAL_SPEC, N_EVAL_ZOO = 200, 100
ZOO_PREFIX = "zoo:"
VS_FLOAT = ("top1_agree", "logit_cos", "agree", "prob_agree")  # spec metrics against the float model
GROUPS = ("all", "bench", "zoo")
MODES = (("Reference", "reference"), ("NPUBackend", "npu"))

_PEAK = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
         "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


# ---------------------------------------------------------------------------------------------------
# build.log
# ---------------------------------------------------------------------------------------------------

_BLOCK = re.compile(r"block (\d+)/(\d+): \[(.*?)\] -> \[(.*?)\]\s+(\d+) layer\(s\)\s+loss (\S+) -> (\S+)(.*?)\s+"
                    r"([\d.]+) s\s*$")
_SUMMARY = re.compile(r"fine-tuning \((\w+)\): (\d+) blocks in ([\d.]+) s, (\d+) rolled back"
                      r"( \(all undone by the whole-model check\))?, (\d+) parameters "
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
                       "rolled_back": int(m.group(4)), "undone": bool(m.group(5)), "parameters": int(m.group(6)),
                       "spilled_samples": int(m.group(7) or 0)}
        elif m := _CACHED.search(line):
            cached = int(m.group(1))
    return {"blocks": blocks, "summary": summary, "cached_parameters": cached}


# ---------------------------------------------------------------------------------------------------
# What one model is benchmarked on: float model, config, calibration, evaluation sets
# ---------------------------------------------------------------------------------------------------

Scorer = Callable[[Any], dict[str, float]]  # a pulsar.Session -> the set's scores


@dataclass
class EvalData:
    """One evaluation set, ready: ``score(session)`` runs the compiled model on it and scores it
    (None: the model has no such set, its columns read ``-``)."""

    name: str
    sources: str
    n: int
    score: Scorer | None
    float_scores: dict[str, float] = field(default_factory=dict)  # the float model's own (label-based) scores
    disjoint: str = ""
    data: dict = field(default_factory=dict, repr=False)  # inputs, labels, float outputs (specs)


@dataclass
class Target:
    key: str  # "mbv2", "zoo:magika"
    title: str
    metric: str  # the headline metric (higher is better)
    vs: str  # what it is measured against
    float_model: Path
    config: dict
    n_calib: int
    calib_sources: str
    sets: list[EvalData]
    disjoint_ok: bool | None = None
    finetune: dict = field(default_factory=dict)  # overrides for the fine-tuning builds (a zoo module's FINETUNE)


def _digests(arrays: list[np.ndarray]) -> set[str]:
    return {hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest() for a in arrays}


def _feed_digest(feed: dict[str, np.ndarray], skip: set[str] = frozenset()) -> str:
    h = hashlib.sha256()
    for k in sorted(k for k in feed if k not in skip):
        h.update(k.encode() + np.ascontiguousarray(feed[k]).tobytes())
    return h.hexdigest()


# --- bench_quant specs ---------------------------------------------------------------------------------


def _ocr_eval_other(n: int) -> tuple[list[np.ndarray], list]:
    """Recognizer lines from sources no other set uses: :func:`assets.direction_lines`' ``other`` word
    list and fonts (Computer Modern, STIX, oblique DejaVu), 1-4 tokens, sizes 22-40 (readable at
    height 48), a quarter light on dark; lines too long for 320 px at height 48 are redrawn."""
    rng = np.random.default_rng(bq.OTHER_SEED)
    vocab, fonts = assets._other_vocabulary(), assets._other_font_paths()
    inputs, texts = [], []
    while len(texts) < n:
        tokens = [assets._random_token(rng, vocab) for _ in range(int(rng.integers(1, 5)))]
        if not any(t.isalpha() for t in tokens):  # every line holds a word of the other list
            tokens[0] = vocab[int(rng.integers(len(vocab)))]
        text = " ".join(tokens)
        img = assets._render_styled_line(rng, text, fonts, (22, 41), 0.25)
        if img.shape[1] * assets.OCR_H / img.shape[0] > assets.OCR_W:
            continue
        inputs.append(assets.ocr_preprocess(np.ascontiguousarray(img[:, :, ::-1])))  # RGB -> BGR
        texts.append(text)
    return inputs, texts


# sets this script adds to a spec that has a single one (the bench_quant registry is left as it is)
EXTRA_SETS: dict[str, list[bq.EvalSet]] = {
    "ocr": [bq.EvalSet("other", "other words, Computer Modern / STIX / oblique DejaVu fonts, a quarter light "
                                "on dark", _ocr_eval_other)],
}


def spec_sets(name: str) -> list[bq.EvalSet]:
    return [*bq.SPECS[name].eval_sets, *EXTRA_SETS.get(name, [])]


def _score(name: str, outs: list[np.ndarray], labels: list, ref: list[np.ndarray]) -> dict[str, float]:
    scores = bq.SPECS[name].score(outs, labels, ref)
    if name == "mbv2" and labels and all(lab is not None for lab in labels):
        top1 = np.array([int(np.asarray(o).argmax()) for o in outs])
        scores["top1_acc"] = float(np.mean(top1 == np.asarray(labels)))
    return scores


def _session_outputs(sess: Any, inputs: list[np.ndarray]) -> list[np.ndarray]:
    in_name, out_name = sess.inputs[0].name, sess.outputs[0].name
    return [np.asarray(o[out_name], np.float32) for o in sess.run_many([{in_name: x} for x in inputs])]


def _check_first_set(name: str, paths: dict[str, Path], calib_tensors: list[np.ndarray], n_eval: int,
                     inputs: list[np.ndarray], labels: list, equal: int) -> tuple[str, bool]:
    """The first sets of mbv2 / ocr: regenerate both sample sets from their sources, check they are
    the files / tensors the build and the evaluation use, and that no evaluation sample is a
    calibration sample."""
    n_calib = len(calib_tensors)
    if name == "ocr":
        files = bq._files(paths["ocr_calib"], "*.npy")
        lines = assets.render_text_lines(n_calib, assets.CALIB_SEED, part="calib")
        matches = all(np.array_equal(assets.ocr_preprocess(img), t)
                      for (img, _), t in zip(lines, calib_tensors, strict=True))
        calib_texts = {t for _, t in lines}
        words = {w.lower() for t in labels for w in t.split() if w.isalpha()}
        shared, in_vocab = len(set(labels) & calib_texts), len(words & set(assets._vocabulary("calib")))
        text = (f"calibration: {files[0].name} .. {files[-1].name} ({n_calib} lines, seed {assets.CALIB_SEED}, "
                f"even words of the vocabulary); this set: {n_eval} lines (seed {bq.EVAL_SEED}, odd words); "
                f"{shared} texts and {in_vocab} words shared, {equal} equal input tensors")
        return text, matches and not shared and not in_vocab and not equal
    files = bq._files(paths["imagenet_calib"], "*.jpg")
    calib_crops = assets.photo_crops(n_calib, assets.CALIB_SEED, part="calib", photos=assets.OBJECT_PHOTOS)
    eval_crops = assets.photo_crops(n_eval, bq.EVAL_SEED, part="eval", photos=assets.OBJECT_PHOTOS)
    # the jpgs are these crops (JPEG quality 95 blurs them a little: each jpg is nearest its own
    # regenerated crop), and the evaluation inputs are these evaluation crops, preprocessed
    crops = np.stack(calib_crops).astype(np.float32)
    errs = np.stack([np.abs(np.asarray(Image.open(f).convert("RGB"), np.float32)[None] - crops).mean((1, 2, 3))
                     for f in files])
    jpg_err = float(np.diag(errs).max())
    jpgs_match = bool(np.array_equal(errs.argmin(1), np.arange(len(files))))
    source_matches = all(np.array_equal(assets.imagenet_preprocess(c), x)
                         for c, x in zip(eval_crops, inputs, strict=True))
    equal_crops = len(_digests(eval_crops) & _digests(calib_crops))
    text = (f"calibration: {files[0].name} .. {files[-1].name} ({n_calib} crops of the first half of each photo, "
            f"seed {assets.CALIB_SEED}; each jpg nearest its regenerated crop, mean |diff| <= {jpg_err:.2f}); "
            f"this set: {n_eval} crops of the other half (seed {bq.EVAL_SEED}); {equal_crops} equal crops, "
            f"{equal} equal input tensors")
    return text, jpgs_match and source_matches and not equal_crops and not equal


def spec_target(name: str, paths: dict[str, Path], args: argparse.Namespace) -> Target:
    spec = bq.SPECS[name]
    float_model, config = spec.prepare(paths)
    calib_tensors = spec.calib(paths, float_model)
    calib_digests = _digests(calib_tensors)
    n = args.eval_n or N_EVAL_SPEC
    sets, ok = [], True
    for i, es in enumerate(spec_sets(name)):
        inputs, labels = es.make(n)
        float_outs = bq._run_ort(float_model, inputs)
        has_labels = bool(labels) and all(lab is not None for lab in labels)
        equal = len(_digests(inputs) & calib_digests)
        if i == 0 and name in ("ocr", "mbv2"):
            text, set_ok = _check_first_set(name, paths, calib_tensors, n, inputs, labels, equal)
        else:
            text, set_ok = f"{equal} of {n} input tensors equal to a calibration tensor", not equal
            if name == "ocr":  # texts and words against the calibration lines
                calib_texts = {t for _, t in assets.render_text_lines(len(calib_tensors), assets.CALIB_SEED,
                                                                       part="calib")}
                words = {w.lower() for t in labels for w in t.split() if w.isalpha()}
                shared, in_vocab = len(set(labels) & calib_texts), len(words & set(assets._vocabulary("calib")))
                text += f"; {shared} texts and {in_vocab} words shared with calibration"
                set_ok = set_ok and not shared and not in_vocab
        ok = ok and set_ok

        def score(sess: Any, inputs=inputs, labels=labels, float_outs=float_outs) -> dict[str, float]:
            return _score(name, _session_outputs(sess, inputs), labels, float_outs)

        float_scores = _score(name, float_outs, labels, float_outs) if has_labels else {}
        float_scores = {k: v for k, v in float_scores.items() if k not in VS_FLOAT}  # 1.0 by definition
        sets.append(EvalData(es.name, es.sources, n, score, float_scores, text,
                             {"inputs": inputs, "labels": labels, "float_outs": float_outs}))
    if not ok:
        raise AssertionError(f"{name}: evaluation and calibration samples are not disjoint / not the expected "
                             f"sets: {[s.disjoint for s in sets]}")
    vs = {"mbv2": "vs float top-1", "ocr": "vs rendered text", "cls": "vs float"}.get(name, "")
    return Target(name, spec.title, spec.keys[0], vs, float_model, config, len(calib_tensors), spec.calib_sources,
                  sets, ok)


# --- zoo models --------------------------------------------------------------------------------------


def _numpy_texts() -> tuple[str, ...]:
    """Prose none of the zoo's data uses: the summary and extended summary of numpy's public
    callables' docstrings (up to the first section header or example), whitespace collapsed."""
    import inspect

    out: dict[str, None] = {}
    for name in sorted(dir(np)):
        obj = getattr(np, name, None)
        doc = getattr(obj, "__doc__", None) if callable(obj) and not name.startswith("_") else None
        if not isinstance(doc, str):
            continue
        keep = []
        for para in inspect.cleandoc(doc).split("\n\n"):
            if "---" in para or para.lstrip().startswith((">>>", "..")):
                break
            para = " ".join(para.split())
            if not re.fullmatch(r"[\w.]+\(.*\)( -> .*)?", para):  # a signature line (ufuncs)
                keep.append(para)
        text = " ".join(keep)
        if len(text.split()) >= 5:
            out[text] = None
    return tuple(out)


def _numpy_sentences() -> list[str]:
    return [s for t in _numpy_texts() for s in re.split(r"(?<=[.!?])\s+", t)
            if 4 <= len(s.split()) <= 25 and s.isascii()]


# espeak-ng voices (and variants) none of bench.zoo._data.VOICES is
OTHER_VOICES = ("en-gb-x-rp", "en-029+f4", "en-gb-x-gbclan+m7", "en-gb-x-gbcwmd+f1", "en-gb+m2", "en-us+f5")


def _other_speech(n: int, seconds: float = 4.0) -> list[np.ndarray]:
    """``n`` clips built as ``bench.zoo._data.speech_clips`` builds them (noise, one spoken sentence at a
    random gain and offset, one clip in eight noise only) from other sources: numpy docstring
    sentences, espeak-ng voices and speeds (110-230 words a minute) the zoo does not use."""
    from bench.zoo import _data

    return _data.mixed_clips(n, np.random.default_rng(102), _numpy_sentences(), OTHER_VOICES, (110, 231), seconds)


def _other_text_page(rng: np.random.Generator, h: int, w: int, *, photo_bg: bool) -> np.ndarray:
    """An RGB uint8 ``h`` x ``w`` page of text lines from sources the zoo's pages do not use
    (:func:`assets.direction_lines`' ``other`` words and fonts, a quarter light on dark), line heights
    14-40 px, on paper or on a faded crop of a photo no other set uses."""
    if photo_bg:
        crop = assets.other_photo_crops(1, int(rng.integers(10**6)))[0]
        bg = np.asarray(Image.fromarray(crop).resize((w, h), Image.BILINEAR), np.float32) * 0.4 + 150
        img = Image.fromarray(bg.astype(np.uint8))
    else:
        img = Image.new("RGB", (w, h), tuple(int(v) for v in rng.integers(200, 256, 3)))
    lines = assets.direction_lines(24, int(rng.integers(10**6)), style="other")
    y, k = int(rng.integers(4, 30)), 0
    while y < h - 12 and k < len(lines):
        bgr, turned = lines[k]
        k += 1
        line = Image.fromarray(np.ascontiguousarray((bgr[::-1, ::-1] if turned else bgr)[:, :, ::-1]))  # upright RGB
        lh = int(rng.integers(14, 41))
        line = line.resize((max(1, round(line.width * lh / line.height)), lh), Image.BILINEAR)
        x = int(rng.integers(4, max(5, w // 4)))
        if rng.random() < 0.85:
            img.paste(line.crop((0, 0, min(line.width, w - x), lh)), (x, y))
        y += int(lh * rng.uniform(1.2, 2.2))
    arr = np.asarray(img, np.float32) + rng.normal(0, 3, (h, w, 3))
    return np.clip(arr, 0, 255).astype(np.uint8)


def _scan_page(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """A random window (60-100% of each side) of scikit-image's scanned text ``page``, resized to ``h`` x ``w``, RGB."""
    from skimage import data

    scan = np.asarray(data.page())
    sh, sw = scan.shape
    ch, cw = int(sh * rng.uniform(0.6, 1.0)), int(sw * rng.uniform(0.6, 1.0))
    y, x = int(rng.integers(0, sh - ch + 1)), int(rng.integers(0, sw - cw + 1))
    win = Image.fromarray(np.ascontiguousarray(scan[y : y + ch, x : x + cw])).convert("RGB")
    return np.asarray(win.resize((w, h), Image.BILINEAR))


def _nudenet_other(mod: Any, n: int, model: Path) -> list[np.ndarray]:
    out: list[Any] = [None] * n
    out[0::2] = bq._lfw_crops(n - n // 2, 5, size=mod.SIZE)
    out[1::2] = assets.other_photo_crops(n // 2, 6)
    return out


def _magika_other_sources() -> tuple[tuple[str, str], ...]:
    import sysconfig

    stdlib, purelib = sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]
    return (
        ("/usr/share/perl", "*/*.pm"), ("/usr/share/perl5", "*/*.pm"), ("/usr/share/i18n/locales", "*"),
        ("/usr/share/bash-completion/completions", "*"), ("/var/lib/dpkg/info", "*.list"),
        ("/var/lib/dpkg/info", "*.md5sums"), ("/var/lib/dpkg/info", "*.postinst"), ("/usr/share/common-licenses", "*"),
        ("/usr/share/ca-certificates", "*/*.crt"), ("/usr/sbin", "*"), ("/usr/share/X11/locale", "*/*"),
        ("/usr/share/info", "*.gz"), (stdlib, "*/*/*.py"), (stdlib, "*/*.txt"), (purelib, "*/*/*/*.py"),
        (purelib, "*/*.md"), (purelib, "*/*/*.pxd"), (purelib, "*/*/*.h"), (purelib, "*/*/*/*.json"),
        (purelib, "*.dist-info/RECORD"), (purelib, "*.dist-info/METADATA"),
    )  # fmt: skip


def _magika_other(mod: Any, n: int, model: Path) -> list[Path]:
    """Readable files of folders / kinds the zoo's SOURCES do not glob, none of its calibration or
    evaluation files, at most PER_SOURCE per source, in a seeded order."""
    rng = np.random.default_rng(4)
    used = {p.resolve() for part in ("calib", "eval") for p in mod.files(part)}
    out: list[Path] = []
    for folder, pattern in _magika_other_sources():
        found = sorted(p for p in Path(folder).glob(pattern)
                       if p.is_file() and not p.is_symlink() and p.stat().st_size >= 8 and p.resolve() not in used)
        if len(found) > mod.PER_SOURCE:
            found = [found[i] for i in sorted(rng.choice(len(found), mod.PER_SOURCE, replace=False))]
        out.extend(found)
    return [out[i] for i in rng.permutation(len(out))[:n]]


def _det_other(mod: Any, n: int, model: Path) -> list[np.ndarray]:
    rng = np.random.default_rng(22)
    return [_other_text_page(rng, mod.SIZE, mod.SIZE, photo_bg=i % 2 == 1) for i in range(n)]


def _orientation_other(mod: Any, n: int, model: Path) -> list[np.ndarray]:
    rng = np.random.default_rng(32)
    pages = []
    for i in range(n):
        h, w = int(rng.integers(240, 420)), int(rng.integers(240, 420))
        page = _scan_page(rng, h, w) if i % 4 == 3 else _other_text_page(rng, h, w, photo_bg=i % 4 == 2)
        pages.append(np.ascontiguousarray(np.rot90(page, int(rng.integers(4)))))
    return pages


def _minilm_other(mod: Any, n: int, model: Path) -> list:
    texts = _numpy_texts()
    idx = np.random.default_rng(5).permutation(len(texts))[:n]
    return mod.encode([texts[i] for i in idx])


def _vad_other(mod: Any, n: int, model: Path) -> list[np.ndarray]:
    return _other_speech(n)


def _oww_other(mod: Any, n: int, model: Path) -> list[np.ndarray]:
    out = [w for clip in _other_speech(max(1, n // 20 + 1)) for w in mod.windows(clip)]
    idx = np.linspace(0, len(out) - 1, min(n, len(out))).round().astype(int)
    return [out[i] for i in idx]


_SPEECH = "numpy docstring sentences spoken by espeak-ng voices / speeds the zoo does not use, in noise"
# zoo model -> (sources, make(module, n, float model) -> evaluation items in the module's format)
ZOO_OTHER: dict[str, tuple[str, Callable[[Any, int, Path], list]]] = {
    "nudenet": ("scikit-image LFW face thumbnails (upscaled) and crops of photos no other set uses", _nudenet_other),
    "magika": ("system files of folders / kinds the zoo's sources skip (perl, locales, dpkg, licences, ...)",
               _magika_other),
    "silero_vad": (_SPEECH, _vad_other),
    "silero_vad_v6": (_SPEECH, _vad_other),
    "oww_embed": (_SPEECH, _oww_other),
    "ppocrv6_det": ("pages of other-word / other-font lines on paper or faded other photos", _det_other),
    "minilm_hf": ("numpy docstrings (summary + extended summary)", _minilm_other),
    "orientation": ("pages of other-word / other-font lines, scikit-image's scanned page, turned 0-270",
                    _orientation_other),
}
ZOO_NO_OTHER = {"layout": "none: the zoo's page generator is fixed to its own words and photos"}


def _session_runner(sess: Any) -> Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    names = {i.name for i in sess.inputs}  # a build may fix an input (const_processors)
    return lambda feed: {k: np.asarray(v) for k, v in sess.run({k: v for k, v in feed.items() if k in names}).items()}


def zoo_target(name: str, work: Path, args: argparse.Namespace) -> Target:
    """A zoo model as bench_zoo builds it: the module's float model, calibration feeds (Numpy folders)
    and CONFIG; scored by the module's predict / score against the float model's predictions."""
    from bench import bench_zoo as bz
    from bench.zoo._data import CACHE

    mod = zoo.load(name)
    model = mod.float_model(CACHE)
    calib = mod.calib_feeds(min(args.calib_n, getattr(mod, "N_CALIB", args.calib_n)), model)
    extra = getattr(mod, "CONFIG", {})
    fixed = {c["name"] for c in extra.get("const_processors", [])}
    config: dict[str, Any] = {"quant": {"input_configs": bz.write_calibration(calib, work / f"zoo_{name}" / "calib",
                                                                              fixed)}}
    for key, value in extra.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    calib_digests = {_feed_digest(f, fixed) for f in calib}
    n = args.eval_n or getattr(mod, "N_EVAL", N_EVAL_ZOO)
    float_run = bz.ort_runner(model)
    makers = [("zoo", f"the zoo's evaluation items (bench.zoo.{zoo.MODELS[name]}.eval_items)",
               lambda: mod.eval_items(n, model))]
    if name in ZOO_OTHER:
        sources, make = ZOO_OTHER[name]
        makers.append(("other", sources, lambda: make(mod, n, model)))
    sets = []
    for set_name, sources, make_items in makers:
        items = make_items()
        seen: list[str] = []

        def recording(feed: dict[str, np.ndarray], seen: list[str] = seen) -> dict[str, np.ndarray]:
            seen.append(_feed_digest(feed, fixed))
            return float_run(feed)

        ref = mod.predict(recording, items)
        equal = sum(d in calib_digests for d in seen)

        def score(sess: Any, items: list = items, ref: list = ref) -> dict[str, float]:
            return mod.score(mod.predict(_session_runner(sess), items), ref)

        sets.append(EvalData(set_name, sources, len(items), score,
                             disjoint=f"{equal} of {len(seen)} model feeds equal to a calibration feed"))
        sets[-1].data["equal"] = equal
    if name not in ZOO_OTHER:
        sets.append(EvalData("other", "- (" + ZOO_NO_OTHER.get(name, "none") + ")", 0, None))
    return Target(ZOO_PREFIX + name, mod.TITLE, mod.KEYS[0], "vs float", model, config, len(calib),
                  f"bench.zoo.{zoo.MODELS[name]}.calib_feeds", sets,
                  not any(s.data.get("equal") for s in sets), finetune=getattr(mod, "FINETUNE", {}))


# ---------------------------------------------------------------------------------------------------
# Builds and scores
# ---------------------------------------------------------------------------------------------------


@dataclass
class Row:
    model: str
    algorithm: str
    build_s: float | None = None
    reference: dict[str, dict[str, float]] = field(default_factory=dict)  # set -> metric -> value
    npu: dict[str, dict[str, float]] = field(default_factory=dict)
    finetune: dict | None = None
    note: str = ""


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _overrides(algo: str, args: argparse.Namespace, extra: dict | None = None) -> dict:
    if algo == "default":
        return {}
    return {f"quant.enable_{algo}": True, "quant.finetune_epochs": args.epochs,
            "quant.finetune_block_size": args.block_size, "quant.device": args.device, **(extra or {})}


def with_weights(config: dict, dtype: str | None) -> dict:
    """``config`` with every weight at ``dtype`` (None: unchanged): a weights-only entry (no data_type)
    for the whole model, so every activation keeps the precision of the default build."""
    if not dtype:
        return config
    quant = dict(config.get("quant", {}))
    entry = {"start_tensor_names": "DEFAULT", "end_tensor_names": "DEFAULT", "weight_data_type": dtype}
    quant["layer_configs"] = [*quant.get("layer_configs", []), entry]
    return {**config, "quant": quant}


def with_layer_configs(config: dict, entries: list[dict] | None) -> dict:
    """``config`` with ``entries`` appended to its quant.layer_configs."""
    if not entries:
        return config
    quant = dict(config.get("quant", {}))
    quant["layer_configs"] = [*quant.get("layer_configs", []), *entries]
    return {**config, "quant": quant}


def with_target(config: dict, target: str | None) -> dict:
    """``config`` built for target profile ``target`` (None: the config's)."""
    return {**config, "target_hardware": target} if target else config


def _entries(text: str) -> list[dict]:
    """--layer-configs: a JSON list of layer_configs entries, or @path of a JSON file holding one."""
    value = json.loads(Path(text[1:]).read_text() if text.startswith("@") else text)
    if not isinstance(value, list) or not all(isinstance(e, dict) for e in value):
        raise argparse.ArgumentTypeError("a JSON list of layer_configs entries (objects)")
    return value


def _add_note(row: Row, note: str) -> None:
    row.note = f"{row.note}; {note}".lstrip("; ")


def bench_target(t: Target, work: Path, args: argparse.Namespace) -> tuple[list[Row], Path | None]:
    """Every algorithm's build of ``t``, each scored on every set in both Session modes."""
    import pulsar

    rows: list[Row] = []
    optimized: Path | None = None
    for algo in args.algorithms:
        print(f"  {t.key}: building {algo}", file=sys.stderr, flush=True)
        out_dir = work / t.key.replace(":", "_") / algo
        start = time.perf_counter()
        try:
            res = pulsar.build(input=str(t.float_model), output_dir=str(out_dir),
                               config=with_target(with_layer_configs(with_weights(t.config, args.weights),
                                                                     args.layer_configs), args.target),
                               overrides=_overrides(algo, args, t.finetune), quiet=True)
        except Exception as exc:  # one failing build must not hide the others' figures
            rows.append(Row(t.key, algo, note=f"build failed: {first_line(exc)}"))
            if args.debug:
                traceback.print_exc()
            continue
        row = Row(t.key, algo, time.perf_counter() - start)
        _add_note(row, f"compiled {Path(res.compiled_model).stat().st_size / 1024:.0f} KiB")
        optimized = optimized or Path(res.optimized_model)
        if algo != "default":
            row.finetune = parse_build_log(Path(res.output_dir) / "build.log")
            if row.finetune["cached_parameters"] is not None:
                row.note = "fine-tuning loaded from the cache (not retrained)"
            elif row.finetune["summary"] is None:
                row.note = "no fine-tuning summary in build.log"
        for mode, key in MODES:
            print(f"  {t.key}: {algo} in {mode}", file=sys.stderr, flush=True)
            try:
                sess = pulsar.Session(Path(res.compiled_model), mode=mode)
            except Exception as exc:
                _add_note(row, f"{mode} failed: {first_line(exc)}")
                continue
            for s in t.sets:
                if s.score is None:
                    continue
                try:
                    getattr(row, key)[s.name] = s.score(sess)
                except Exception as exc:
                    _add_note(row, f"{mode} on {s.name} failed: {first_line(exc)}")
                    if args.debug:
                        traceback.print_exc()
        rows.append(row)
    return rows, optimized


def ort_ocr(t: Target, paths: dict[str, Path], work: Path, optimized: Path | None, rows: list[Row]) -> dict:
    """onnxruntime's quantize_static (MinMax) on the same graph and calibration samples, timed."""
    folder = work / t.key
    folder.mkdir(parents=True, exist_ok=True)
    src = optimized or bq._ort_input_fallback(t.float_model, folder / "float_fixed.onnx")
    calib = bq.SPECS[t.key].calib(paths, src)
    dest = folder / "ort_MinMax.onnx"
    print(f"  {t.key}: onnxruntime quantize_static MinMax", file=sys.stderr, flush=True)
    seconds = bq._ort_quantize(src, dest, calib, "MinMax")
    reference = {s.name: _score(t.key, bq._run_ort(dest, s.data["inputs"], bq._qdq_options("float")),
                                s.data["labels"], s.data["float_outs"]) for s in t.sets if s.data.get("inputs")}
    return {"graph": "pulsar optimized" if optimized else "source (shape fixed, opset 17)",
            "calibration_samples": len(calib), "seconds": seconds, "reference": reference,
            "ratio": {r.algorithm: r.build_s / seconds for r in rows
                      if r.algorithm != "default" and r.build_s is not None}}


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


def format_target(fig: dict, args: argparse.Namespace) -> str:
    name, metric, sets, rows = fig["model"], fig["metric"], fig["sets"], fig["rows"]
    lines = [f"{fig['title']} ({name}): {fig['calibration']['n']} calibration samples ({fig['calibration']['sources']}); "
             f"metric {metric} ({fig['vs']}); fine-tuning: {args.epochs} steps per block, block size "
             f"{args.block_size}, device {args.device}"]
    for s in sets:
        if not s["n"]:
            lines.append(f"  set {s['name']!r}: {s['sources']}")
            continue
        lines.append(f"  set {s['name']!r}: {s['n']} samples, {s['sources']}")
        lines.append(f"    disjoint: {s['disjoint']}")
        if s["float"]:
            lines.append("    float model: " + ", ".join(f"{k} {v:.3f}" for k, v in s["float"].items()))
    if not fig["disjoint"]:
        lines.append("  NOTE: some evaluation feeds equal calibration feeds (see 'disjoint' above)")
    default = next((r for r in rows if r["algorithm"] == "default"), None)

    def cell(r: dict, key: str, s: str) -> tuple[str, str]:
        v = r[key].get(s, {}).get(metric)
        d = default[key].get(s, {}).get(metric) if default else None
        return _fmt(v), _fmt(None if v is None or d is None else v - d, signed=True)

    head = ["model", "algorithm", "build s"]
    for s in sets:
        head += [f"{s['name']} Ref", "diff", f"{s['name']} NPU", "diff"]
    head += ["blocks", "rolled back", "nothing to train", "finetune s", "note"]
    body = []
    for r in rows:
        ft = r["finetune"] or {}
        summary = ft.get("summary") or {}
        cells = []
        for s in sets:
            cells += [*cell(r, "reference", s["name"]), *cell(r, "npu", s["name"])]
        body.append([
            name, r["algorithm"], _fmt(r["build_s"], ".1f"), *cells,
            str(summary.get("blocks", len(ft["blocks"]) if ft else "-")),
            str(summary.get("rolled_back", sum(b["rolled_back"] for b in ft["blocks"]) if ft else "-")),
            str(sum(b["nothing_to_train"] for b in ft["blocks"])) if ft else "-",
            _fmt(summary.get("seconds"), ".1f"),
            r["note"] or ("cached" if ft and ft.get("cached_parameters") is not None
                          else "undone: the whole model was no better" if summary.get("undone") else ""),
        ])
    ort_fig = fig["ort_quantize_static"]
    if ort_fig:
        row = {"algorithm": "ORT", "reference": ort_fig["reference"], "npu": {}}
        cells = []
        for s in sets:
            cells += [*cell(row, "reference", s["name"]), "-", "-"]
        body.append([name, "ORT quantize_static MinMax", _fmt(ort_fig["seconds"], ".1f"), *cells, "-", "-", "-", "-",
                     "onnxruntime, QDQ run as float math; seconds: quantize_static alone"])
    lines += ["  " + x for x in _table(head, body)]
    for r in rows:
        rolled = [b for b in (r["finetune"] or {}).get("blocks", []) if b["rolled_back"]]
        if rolled:
            lines.append(f"  {r['algorithm']}: rolled back blocks: "
                         + ", ".join(f"{b['index']}/{b['of']} [{b['inputs']}] -> [{b['outputs']}]" for b in rolled))
    if ort_fig:
        lines.append(f"  onnxruntime quantize_static (MinMax, QDQ, per channel, {ort_fig['calibration_samples']} "
                     f"calibration samples, {ort_fig['graph']} graph): {ort_fig['seconds']:.1f} s")
        for algo, ratio in ort_fig["ratio"].items():
            lines.append(f"  {algo} build s / quantize_static s: {ratio:.1f}")

    # every metric of every set and mode
    scored = [(r["algorithm"], mode, r[key]) for r in rows for mode, key in (("Ref", "reference"), ("NPU", "npu"))]
    if ort_fig:
        scored.append(("ORT quantize_static MinMax", "Ref", ort_fig["reference"]))
    keys = list(dict.fromkeys(k for _, _, by_set in scored for sc in by_set.values() for k in sc))
    if keys:
        body = [[algo, s["name"], mode, *(_fmt(by_set[s["name"]].get(k), ".4g") for k in keys)]
                for s in sets for algo, mode, by_set in scored if s["name"] in by_set]
        lines += ["  all metrics:", *("    " + x for x in _table(["algorithm", "set", "mode", *keys], body))]
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


def resolve_models(names: list[str]) -> list[str]:
    """Spec names, ``zoo:<name>`` (or the plain zoo name) and the groups all / bench / zoo -> keys."""
    out: list[str] = []
    for m in names:
        if m in ("all", "bench"):
            out += list(bq.SPECS)
        if m in ("all", "zoo"):
            out += [ZOO_PREFIX + z for z in zoo.MODELS]
        if m in GROUPS:
            continue
        if m in bq.SPECS:
            out.append(m)
        elif m.removeprefix(ZOO_PREFIX) in zoo.MODELS:
            out.append(ZOO_PREFIX + m.removeprefix(ZOO_PREFIX))
        else:
            raise ValueError(m)
    return list(dict.fromkeys(out))


def _figures(t: Target, rows: list[Row], ort_fig: dict | None, seconds: float) -> dict:
    return {"model": t.key, "title": t.title, "metric": t.metric, "vs": t.vs,
            "calibration": {"n": t.n_calib, "sources": t.calib_sources},
            "sets": [{"name": s.name, "sources": s.sources, "n": s.n, "float": s.float_scores, "disjoint": s.disjoint}
                     for s in t.sets],
            "disjoint": bool(t.disjoint_ok), "rows": [asdict(r) for r in rows], "ort_quantize_static": ort_fig,
            "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    models_help = (f"comma list of groups ({', '.join(GROUPS)}), bench_quant specs ({', '.join(bq.SPECS)}) and zoo "
                   f"models (zoo:<name> or <name>: {', '.join(zoo.MODELS)}); default all")
    parser = argparse.ArgumentParser(description="fine-tuning (AdaRound / BRECQ / LSQ) vs the default quantization")
    parser.add_argument("--models", type=bq._csv, default=["all"], help=models_help)
    parser.add_argument("--algorithms", type=bq._csv, default=list(ALGORITHMS),
                        help=f"comma list of {', '.join(ALGORITHMS)}")
    parser.add_argument("--epochs", type=int, default=100, help="quant.finetune_epochs (optimizer steps per block)")
    parser.add_argument("--block-size", type=int, default=4, help="quant.finetune_block_size")
    parser.add_argument("--eval-n", type=int,
                        help=f"evaluation samples per set (default {N_EVAL_SPEC} for the bench_quant specs, the zoo "
                             f"module's N_EVAL or {N_EVAL_ZOO} for zoo models)")
    parser.add_argument("--calib-n", type=int, default=N_CALIB,
                        help=f"calibration samples (default {N_CALIB}; a zoo module's N_CALIB caps it)")
    parser.add_argument("--device", default="cpu", help="quant.device: cpu, cuda or cuda:N")
    parser.add_argument("--memory", action="store_true",
                        help="also the peak RSS of an mbv2 LSQ build at calibration_size 256 vs 32")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    parser.add_argument("--work-dir", type=Path,
                        help="make this run's fresh folder here and keep it (default: a temporary folder, removed)")
    parser.add_argument("--debug", action="store_true", help="print tracebacks of failures")
    parser.add_argument("--layer-configs", type=_entries,
                        help="quant.layer_configs entries appended to every build: a JSON list, or @file.json")
    parser.add_argument("--target", help="target_hardware of every build (a built-in name or a profile file)")
    parser.add_argument("--weights", choices=["S4", "U4", "S8", "S16"],
                        help="weight_data_type of every weight (default: the config's, S8)")
    args = parser.parse_args(argv)
    try:
        args.models = resolve_models(args.models)
    except ValueError as exc:
        parser.error(f"unknown model {exc}; {models_help}")
    bad = [a for a in args.algorithms if a not in ALGORITHMS]
    if bad:
        parser.error(f"unknown algorithm(s) {bad}; choose from {list(ALGORITHMS)}")
    if args.epochs < 1 or args.block_size < 1 or args.calib_n < 1 or (args.eval_n is not None and args.eval_n < 1):
        parser.error("--epochs, --block-size, --eval-n and --calib-n must be at least 1")
    ort.set_default_logger_severity(3)

    if args.work_dir:
        args.work_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-finetune-", dir=args.work_dir))  # fresh: no cache from a past run
    print(f"work dir: {work} (fresh: no statistics or fine-tuning cache from an earlier run"
          f"{'' if args.work_dir else '; removed at the end'})", flush=True)
    results: dict = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                     "work_dir": str(work), "models": {}}
    t_all = time.perf_counter()
    try:
        paths: dict[str, Path] = {}
        if any(m in bq.SPECS for m in args.models):
            paths = assets.make_example_assets(work / "assets", n_calib=args.calib_n)
            if "cls" in args.models:
                paths.update(assets.make_cls_assets(work / "assets", n_calib=args.calib_n))
        for key in args.models:
            print(f"== {key}", file=sys.stderr, flush=True)
            start = time.perf_counter()
            try:
                t = spec_target(key, paths, args) if key in bq.SPECS else zoo_target(key[len(ZOO_PREFIX):], work, args)
            except zoo.Skip as exc:
                print(f"{key}: skipped: {exc}\n", flush=True)
                results["models"][key] = {"skipped": str(exc)}
                continue
            except AssertionError:  # calibration / evaluation overlap: the figures would mean nothing
                raise
            except Exception as exc:  # the float model or the data: report it, go on with the next model
                traceback.print_exc()
                print(f"{key}: FAILED: {first_line(exc)}\n", flush=True)
                results["models"][key] = {"failed": first_line(exc)}
                continue
            rows, optimized = bench_target(t, work, args)
            ort_fig = ort_ocr(t, paths, work, optimized, rows) if key == "ocr" else None
            fig = results["models"][key] = _figures(t, rows, ort_fig, time.perf_counter() - start)
            print(format_target(fig, args) + f"\n  {fig['seconds']:.0f} s in all\n", flush=True)
            if args.json:  # after every model, so a crash later keeps the figures so far
                args.json.write_text(json.dumps(results, indent=2))
        if args.memory:
            print("== peak memory", file=sys.stderr, flush=True)
            results["memory"] = bench_memory(work, args)
            print(format_memory(results["memory"]) + "\n", flush=True)
        print(f"total {time.perf_counter() - t_all:.0f} s", flush=True)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
