"""Paths of ``pulsar run``, checked before anything runs: a typo is one line naming the flag, never a
traceback, a half-written output directory or a file written outside ``--output_dir``.

- Path text: a NUL byte or another control character (a pasted newline, an escape sequence) is
  refused; such names are almost always accidents and would be unreadable in messages.
- ``--output_dir``: missing directories are created; an existing file there (or as a parent), or a
  place that cannot be created or written, is an error. Directories made for a run that fails are
  removed again.
- ``--list``: UTF-8 text, one sample directory a line (relative to ``--input_dir`` or absolute;
  blank lines and ``#`` comments skipped). Each sample's outputs go to
  ``<output_dir>/<sample directory name>/``; a name that is unsafe (``..``, empty) or already taken
  by an earlier line gets ``_line<N>`` (its line in the list) appended, so no two samples share a
  directory and nothing lands outside ``--output_dir``.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pulsar.errors import PulsarError
from pulsar.ui import literal

log = logging.getLogger(__name__)

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_path_text(flag: str, path: str | os.PathLike[str]) -> Path:
    """``path`` as a Path, or an error naming ``flag`` when its text holds a NUL or control character."""
    text = os.fspath(path)
    bad = _CONTROL.search(text)
    if bad:
        what = "a NUL byte" if bad.group(0) == "\0" else f"a control character ({literal(bad.group(0))})"
        raise PulsarError(f"{flag} '{literal(text)}' contains {what} at position {bad.start()}; fix the path")
    return Path(text)


# --------------------------------------------------------------------------- output directory


def _remove_empty(dirs: list[Path]) -> None:
    for d in reversed(dirs):  # deepest first
        try:
            d.rmdir()
        except OSError:
            return


def prepare_output_dir(path: Path, flag: str = "--output_dir") -> list[Path]:
    """Create ``path`` (with missing parents) and check it can be written; returns the directories
    created, for :func:`discard_created` when the run fails."""
    missing, existing = [], path
    while not os.path.lexists(existing):
        missing.append(existing)
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        if existing == path:
            raise PulsarError(f"{flag} {path} exists and is not a directory; give a directory (it is created "
                              "when missing)")
        raise PulsarError(f"{flag} {path}: {existing} is a file, not a directory; choose another {flag}")
    created: list[Path] = []
    for d in reversed(missing):
        try:
            d.mkdir()
        except OSError as exc:
            _remove_empty(created)
            raise PulsarError(f"{flag} {path} cannot be created ({exc.strerror or exc}); choose another "
                              f"{flag}") from None
        created.append(d)
    try:
        fd, probe = tempfile.mkstemp(dir=path, prefix=".pulsar-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        _remove_empty(created)
        raise PulsarError(f"{flag} {path} is not writable ({exc.strerror or exc}); choose another {flag}") from None
    return created


def discard_created(created: list[Path]) -> None:
    """Remove the directories :func:`prepare_output_dir` made, where they stayed empty."""
    _remove_empty(created)


def inside(root: Path, dest: Path, flag: str = "--output_dir") -> Path:
    """``dest``, after checking that it resolves inside ``root`` (a symlink could point elsewhere)."""
    if not dest.resolve().is_relative_to(root.resolve()):
        raise PulsarError(f"{flag}: {dest} resolves to {dest.resolve()}, outside {root}; remove the link or choose "
                          f"another {flag}")
    return dest


# --------------------------------------------------------------------------- list file


@dataclass(frozen=True)
class ListEntry:
    line: int  # 1-based line in the list file
    sample_dir: Path  # where the sample's input files are
    output_name: str  # the sample's directory under --output_dir


def _read_text(list_path: Path, flag: str) -> str:
    if list_path.is_dir():
        raise PulsarError(f"{flag} {list_path} is a directory; give a text file with one sample directory a line")
    if not list_path.exists():
        raise PulsarError(f"{flag} file {list_path} does not exist")
    try:
        data = list_path.read_bytes()
    except OSError as exc:
        raise PulsarError(f"{flag} file {list_path} cannot be read ({exc.strerror or exc})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise PulsarError(f"{flag} file {list_path}:{line}: byte {exc.start} (0x{data[exc.start]:02x}) is not UTF-8 "
                          "text; save the list as UTF-8") from None


def _unique_name(name: str, line: int, used: set[str]) -> str:
    """``name``, or ``<name>_line<N>`` when it is unsafe or taken (compared case-insensitively)."""
    if name not in ("", ".", "..") and name.casefold() not in used:
        return name
    base = f"{name}_line{line}" if name not in ("", ".", "..") else f"sample_line{line}"
    out, i = base, 1
    while out.casefold() in used:
        i += 1
        out = f"{base}_{i}"
    return out


def read_sample_list(list_path: str | os.PathLike[str], input_dir: str | os.PathLike[str],
                     flag: str = "--list") -> list[ListEntry]:
    """The list's sample directories (each checked to exist) with distinct, safe output names."""
    list_path, input_dir = Path(list_path), Path(input_dir)
    entries: list[ListEntry] = []
    used: set[str] = set()
    for lineno, line in enumerate(_read_text(list_path, flag).splitlines(), start=1):
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        bad = _CONTROL.search(entry)
        if bad:
            raise PulsarError(f"{flag} file {list_path}:{lineno}: the entry holds a control character "
                              f"({literal(bad.group(0))}); fix the line")
        sample = Path(entry) if Path(entry).is_absolute() else input_dir / entry
        if not sample.is_dir():
            raise PulsarError(f"{flag} file {list_path}:{lineno}: sample directory {sample} does not exist")
        name = _unique_name(sample.name, lineno, used)
        used.add(name.casefold())
        if name != sample.name:
            log.info("%s:%d: outputs of %s go to %s/ (its own name is unsafe or taken by an earlier line)",
                     list_path, lineno, sample, name)
        entries.append(ListEntry(lineno, sample, name))
    if not entries:
        raise PulsarError(f"{flag} file {list_path} lists no sample directories")
    return entries


# --------------------------------------------------------------------------- memory


def available_memory() -> int | None:
    """Bytes the kernel says can be allocated without swapping (MemAvailable), None when unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def human_bytes(n: int) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} bytes"


def read_list_file(list_path: str | os.PathLike[str], input_dir: str | os.PathLike[str]) -> list[Path]:
    """Sample directories listed one a line (relative to ``input_dir`` or absolute); see
    :func:`read_sample_list` for their output names."""
    return [e.sample_dir for e in read_sample_list(list_path, input_dir)]
