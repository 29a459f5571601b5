"""Files in a ``pulsar run`` input directory that no model input reads.

``pulsar run`` reads ``<input>.npy`` or ``<input>.bin`` per model input and nothing else, so a file
named slightly wrong (``images.npy`` beside ``image.npy``) would be ignored without a word while the
user believes it was fed. Each such file gets a warning; a name close to an input's file is likely a
typo, and the warning says which input it resembles.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path

from pulsar.core.tensor_io import tensor_file_stem
from pulsar.core.tensors import TensorInfo
from pulsar.ui import plural

SUFFIXES = (".npy", ".bin")
MAX_WARNINGS = 5  # a folder of unrelated files is named once, not file by file


def _describe(path: Path, stems: dict[str, str]) -> str:
    lower = {s.lower(): s for s in stems}  # Image.npy is as much a typo of image.npy as images.npy
    near = difflib.get_close_matches(path.stem.lower(), list(lower), n=1, cutoff=0.6)
    if near:
        stem = lower[near[0]]
        return (f'{path}: no model input reads this file; it resembles {stem}.npy, the file of input '
                f'"{stems[stem]}" (a typo?): rename or remove it')
    wanted = ", ".join(f'"{name}" ({stem}.npy or .bin)' for stem, name in stems.items())
    return f"{path}: no model input reads this file (the model's inputs: {wanted}); remove it or fix its name"


def unread_files(folders: Iterable[Path], inputs: list[TensorInfo]) -> list[str]:
    """One warning per file in ``folders`` that no input reads (hidden files and sub-directories are
    not looked at: sample directories and editor files), at most :data:`MAX_WARNINGS` and a count."""
    stems = {tensor_file_stem(i.name): i.name for i in inputs}
    read = {f"{stem}{suffix}" for stem in stems for suffix in SUFFIXES}
    unread = [p for folder in folders for p in sorted(folder.iterdir())
              if p.name not in read and not p.name.startswith(".") and p.is_file()]
    lines = [_describe(p, stems) for p in unread[:MAX_WARNINGS]]
    if len(unread) > MAX_WARNINGS:
        lines.append(f"{plural(len(unread) - MAX_WARNINGS, 'more file')} that no model input reads, e.g. "
                     f"{unread[-1]}")
    return lines
