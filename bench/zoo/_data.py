"""Real data for the zoo, made from installed packages and system files (nothing is downloaded).

- photos: scikit-image / scikit-learn / matplotlib sample photos (``examples.assets``), calibration
  and evaluation crops from opposite halves of each photo;
- text pages: English words from CPython's documentation drawn with matplotlib's DejaVu fonts on
  paper or on photo crops;
- speech: English sentences spoken by ``espeak-ng`` (several voices and speeds), mixed with silence
  and noise, 16 kHz float32; :class:`~bench.zoo.Skip` without espeak-ng;
- sentences: CPython's ``pydoc_data`` prose (``examples.minilm.sentences``).

``part`` is ``"calib"`` or ``"eval"``: the two never share a photo half, a sentence or a word.
"""

from __future__ import annotations

import functools
import hashlib
import shutil
import subprocess
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from bench.zoo import Skip

Part = Literal["calib", "eval"]
SEEDS = {"calib": 0, "eval": 1}
SR = 16000
CACHE = Path(__file__).resolve().parents[2] / "examples" / "assets" / "zoo"


def photo_crops(n: int, part: Part, size: int = 320, photos: tuple[str, ...] | None = None,
                seed: int = 10) -> list[np.ndarray]:
    """``n`` RGB uint8 square crops of the sample photos (calibration and evaluation: other halves)."""
    from examples import assets

    return assets.photo_crops(n, SEEDS[part] + seed, size, part=part, photos=photos)


@functools.cache
def sentences(part: Part) -> tuple[str, ...]:
    """Disjoint English sentences from CPython's documentation (calib: 64, eval: 400)."""
    from examples import minilm

    calib, queries, corpus = minilm.sentences(64, 200)
    return tuple(calib) if part == "calib" else tuple(queries + corpus)


@functools.cache
def words(part: Part) -> tuple[str, ...]:
    """Distinct words of the part's sentences (a word of both parts goes to calibration)."""
    calib = {w.strip(".,;:()'\"") for s in sentences("calib") for w in s.split()}
    if part == "calib":
        return tuple(sorted(w for w in calib if w))
    ev = {w.strip(".,;:()'\"") for s in sentences("eval") for w in s.split()}
    return tuple(sorted(w for w in ev - calib if w))


@functools.cache
def _fonts() -> tuple[Path, ...]:
    import matplotlib

    folder = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
    return tuple(sorted(folder.glob("DejaVu*.ttf")))


def text_page(rng: np.random.Generator, part: Part, h: int, w: int, *, photo_bg: bool = False) -> np.ndarray:
    """An RGB uint8 ``h`` x ``w`` page: lines of words in random DejaVu fonts and sizes, dark on paper
    (or on a photo crop), with a few blank gaps."""
    vocab = words(part)
    if photo_bg:
        img = Image.fromarray(_bg_photo(rng, part, max(h, w))).crop((0, 0, w, h))
    else:
        img = Image.new("RGB", (w, h), tuple(int(v) for v in rng.integers(200, 256, 3)))
    draw = ImageDraw.Draw(img)
    fonts = _fonts()
    y = int(rng.integers(4, 30))
    while y < h - 10:
        size = int(rng.integers(12, 40))
        font = ImageFont.truetype(str(fonts[int(rng.integers(len(fonts)))]), size)
        x = int(rng.integers(4, max(5, w // 4)))
        line = " ".join(vocab[int(i)] for i in rng.integers(0, len(vocab), int(rng.integers(2, 9))))
        ink = tuple(int(v) for v in rng.integers(0, 80, 3))
        if rng.random() < 0.8:
            draw.text((x, y), line, font=font, fill=ink)
        y += int(size * rng.uniform(1.3, 2.5))
    arr = np.asarray(img, np.float32) + rng.normal(0, 3, (h, w, 3))
    return np.clip(arr, 0, 255).astype(np.uint8)


def _bg_photo(rng: np.random.Generator, part: Part, size: int) -> np.ndarray:
    crop = photo_crops(1, part, size, seed=int(rng.integers(1000, 10**6)))[0].astype(np.float32)
    return (crop * 0.4 + 150).astype(np.uint8)  # faded, so dark text stays readable


# ---------------------------------------------------------------------------------------------------
# Speech
# ---------------------------------------------------------------------------------------------------

VOICES = ("en", "en-us", "en+f3", "en+m3", "en-gb-scotland", "en+f2", "en-us+m5", "en+klatt")


def espeak() -> str:
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise Skip("espeak-ng not found: apt-get install espeak-ng (speech for the audio models)")
    return exe


def speak(text: str, voice: str, speed: int) -> np.ndarray:
    """``text`` spoken by espeak-ng, float32 in [-1, 1] at 16 kHz (cached under the zoo cache)."""
    from scipy.io import wavfile
    from scipy.signal import resample_poly

    key = hashlib.sha1(f"{voice}|{speed}|{text}".encode()).hexdigest()[:16]
    path = CACHE / "speech" / f"{key}.wav"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.wav")
        subprocess.run([espeak(), "-v", voice, "-s", str(speed), "-w", str(tmp), text], check=True,
                       capture_output=True, timeout=60)
        tmp.replace(path)
    rate, data = wavfile.read(path)
    x = data.astype(np.float32) / 32768.0
    g = np.gcd(rate, SR)
    return resample_poly(x, SR // g, rate // g).astype(np.float32)


def speech_clips(n: int, part: Part, seconds: float = 4.0) -> list[np.ndarray]:
    """``n`` clips of ``seconds``: silence / noise, a spoken sentence at a random gain and offset,
    more silence; background noise at a random level (some clips are noise only)."""
    return mixed_clips(n, np.random.default_rng(SEEDS[part] + 100), sentences(part), VOICES, (130, 200), seconds)


def mixed_clips(n: int, rng: np.random.Generator, pool: list[str], voices: tuple[str, ...] | list[str],
                speeds: tuple[int, int], seconds: float = 4.0) -> list[np.ndarray]:
    """Clips of background noise at a random level, seven in eight with one sentence of ``pool`` spoken
    by one of ``voices`` at ``speeds`` (words a minute: ``rng.integers``' low and exclusive high) at a
    random gain and offset."""
    length = int(seconds * SR)
    clips = []
    for i in range(n):
        clip = rng.normal(0, 10 ** rng.uniform(-4, -2), length).astype(np.float32)
        if i % 8 != 7:  # one clip in eight holds no speech
            s = speak(pool[int(rng.integers(len(pool)))], voices[int(rng.integers(len(voices)))],
                      int(rng.integers(speeds[0], speeds[1])))
            s = s[: int(length * 0.8)] * rng.uniform(0.3, 1.0)
            start = int(rng.integers(0, length - len(s) + 1))
            clip[start : start + len(s)] += s
        clips.append(np.clip(clip, -1, 1))
    return clips
