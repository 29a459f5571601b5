"""Where calibration files come from: a directory, a tar (optionally compressed) or a zip.

Archives are read in place (never extracted to disk), opened once and kept open while the samples
are streamed. Every member is checked before anything is read: a path that could escape a
directory, a link or a device is refused, and sizes are capped so a small archive cannot expand
into gigabytes (zip bomb). Listing is cheap: only names, sizes and time stamps are collected.
"""

from __future__ import annotations

import logging
import os
import stat
import tarfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from pulsar.errors import PulsarError

log = logging.getLogger(__name__)

MAX_MEMBER_BYTES = 1 << 30  # 1 GiB per file: far above any calibration sample, far below a zip bomb
_IGNORED_DIRS = frozenset({"__MACOSX"})


@dataclass(frozen=True)
class Member:
    """One file of a source: its relative POSIX path, size and a cheap change stamp (mtime / CRC)."""

    name: str
    size: int
    stamp: int


def is_ignored(name: str) -> bool:
    """Hidden files / folders and macOS resource forks are never calibration data."""
    parts = PurePosixPath(name).parts
    return any(p.startswith(".") or p in _IGNORED_DIRS for p in parts)


class Source:
    """Base class: ``members()`` lists files, ``read()`` returns one file's bytes."""

    kind = "source"

    def __init__(self, path: Path, field: str) -> None:
        self.path = path
        self.field = field
        self._members: list[Member] | None = None

    def members(self) -> list[Member]:
        """All regular, non-hidden files sorted by relative path (cached; no data read)."""
        if self._members is None:
            found = [m for m in self._list() if not is_ignored(m.name)]
            self._members = sorted(found, key=lambda m: m.name)
        return self._members

    def read(self, member: Member) -> bytes:
        if member.size > MAX_MEMBER_BYTES:
            raise PulsarError(self._too_big(member.name, member.size))
        data = self._read(member)
        if len(data) > MAX_MEMBER_BYTES:
            raise PulsarError(self._too_big(member.name, len(data)))
        return data

    def close(self) -> None:
        """Release the open archive (nothing to do for a directory)."""

    def check_order(self, members: list[Member]) -> None:
        """Warn when reading ``members`` in this order will be slow (nothing to check by default)."""

    def origin(self, member: Member) -> str:
        """How a member is named in messages: the file path, or ``archive:member``."""
        return f"{self.path}:{member.name}"

    def _too_big(self, name: str, size: int) -> str:
        return (
            f"{self.path}: member '{name}' is {size} bytes, more than the {MAX_MEMBER_BYTES} byte limit "
            f"for one calibration sample ({self.field}.calibration_dataset); split or shrink the file"
        )

    def _unsafe(self, name: str, why: str) -> PulsarError:
        return PulsarError(
            f"{self.path}: unsafe member '{name}' ({why}) in {self.field}.calibration_dataset; "
            f"rebuild the archive with plain files under relative paths"
        )

    def _check_name(self, name: str) -> str:
        """Normalise an archive member name; refuse absolute paths and '..' components."""
        posix = name.replace("\\", "/")
        if posix.startswith("/") or (len(posix) > 1 and posix[1] == ":"):
            raise self._unsafe(name, "absolute path")
        parts = PurePosixPath(posix).parts
        if ".." in parts:
            raise self._unsafe(name, "'..' path component")
        return "/".join(parts)

    def _list(self) -> Iterator[Member]:
        raise NotImplementedError

    def _read(self, member: Member) -> bytes:
        raise NotImplementedError


_SOURCES: dict[str, Callable[[Path, str], Source]] = {}


def register_source(*suffixes: str) -> Callable[[type[Source]], type[Source]]:
    def wrap(cls: type[Source]) -> type[Source]:
        for suffix in suffixes:
            _SOURCES[suffix] = cls
        return cls

    return wrap


class DirSource(Source):
    """A directory, walked recursively in sorted order."""

    kind = "directory"

    def origin(self, member: Member) -> str:
        return str(self.path / member.name)

    def _list(self) -> Iterator[Member]:
        for root, dirs, files in os.walk(self.path):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _IGNORED_DIRS)
            for fname in sorted(files):
                full = Path(root) / fname
                rel = full.relative_to(self.path).as_posix()
                if is_ignored(rel):
                    continue
                try:
                    st = full.stat()
                except OSError as exc:  # a dangling link, a loop: a sample the user meant but we cannot read
                    raise PulsarError(f"{full}: cannot read this calibration file ({exc.strerror}); fix or remove "
                                      f"it ({self.field}.calibration_dataset)") from None
                if not stat.S_ISREG(st.st_mode):  # a FIFO or device would block or never end
                    raise PulsarError(f"{full}: not a regular file; calibration data must be plain files "
                                      f"({self.field}.calibration_dataset)")
                yield Member(rel, st.st_size, st.st_mtime_ns)

    def _read(self, member: Member) -> bytes:
        try:
            with open(self.path / member.name, "rb") as f:
                return f.read(MAX_MEMBER_BYTES + 1)
        except OSError as exc:
            raise PulsarError(f"{self.path / member.name}: cannot read this calibration file ({exc.strerror}); "
                              f"fix or remove it ({self.field}.calibration_dataset)") from None


@register_source(".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")
class TarSource(Source):
    """A tar archive (any compression tarfile knows), read member by member with extractfile."""

    kind = "tar"

    def __init__(self, path: Path, field: str) -> None:
        super().__init__(path, field)
        try:
            self._tar = tarfile.open(path, "r:*")  # noqa: SIM115 - kept open while streaming, closed by close()
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise PulsarError(f"{field}.calibration_dataset: cannot open tar archive {path}: {exc}") from None
        self._infos: dict[str, tarfile.TarInfo] = {}

    def _list(self) -> Iterator[Member]:
        try:
            infos = self._tar.getmembers()
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise PulsarError(
                f"{self.field}.calibration_dataset: corrupt tar archive {self.path}: {exc}"
            ) from None
        for info in infos:
            if info.issym() or info.islnk():
                raise self._unsafe(info.name, f"link to '{info.linkname}'")
            if info.isdev() or info.isfifo():
                raise self._unsafe(info.name, "device or fifo")
            name = self._check_name(info.name)
            if info.isdir() or not name:
                continue
            if not info.isfile():
                raise self._unsafe(info.name, "not a regular file")
            if name in self._infos:
                raise PulsarError(f"{self.path}: member '{name}' appears twice; rebuild the archive")
            self._infos[name] = info
            yield Member(name, info.size, int(info.mtime))

    def _read(self, member: Member) -> bytes:
        handle = self._tar.extractfile(self._infos[member.name])
        if handle is None:  # pragma: no cover - _list keeps regular files only
            raise PulsarError(f"{self.path}: member '{member.name}' is not a regular file")
        with handle:
            return handle.read(MAX_MEMBER_BYTES + 1)

    def check_order(self, members: list[Member]) -> None:
        """A compressed tar can only seek backwards by decompressing again from the start."""
        if type(self._tar.fileobj).__module__ not in ("gzip", "bz2", "lzma"):
            return
        offsets = [self._infos[m.name].offset for m in members]
        if offsets != sorted(offsets):
            log.warning(
                "%s: members are not stored in sorted name order, so reading this compressed tar seeks "
                "backwards (slow); repack it sorted (tar --sort=name) or use a directory, .tar or .zip",
                self.path,
            )

    def close(self) -> None:
        self._tar.close()


@register_source(".zip")
class ZipSource(Source):
    """A zip archive; symlinks (stored in the Unix mode bits) are refused."""

    kind = "zip"

    def __init__(self, path: Path, field: str) -> None:
        super().__init__(path, field)
        try:
            self._zip = zipfile.ZipFile(path)
        except (zipfile.BadZipFile, OSError) as exc:
            raise PulsarError(f"{field}.calibration_dataset: cannot open zip archive {path}: {exc}") from None
        self._infos: dict[str, zipfile.ZipInfo] = {}

    def _list(self) -> Iterator[Member]:
        for info in self._zip.infolist():
            mode = info.external_attr >> 16
            if stat.S_ISLNK(mode):
                raise self._unsafe(info.filename, "symbolic link")
            if stat.S_IFMT(mode) and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise self._unsafe(info.filename, "not a regular file")
            name = self._check_name(info.filename)
            if info.is_dir() or not name:
                continue
            if name in self._infos:
                raise PulsarError(f"{self.path}: member '{name}' appears twice; rebuild the archive")
            self._infos[name] = info
            yield Member(name, info.file_size, info.CRC)

    def _read(self, member: Member) -> bytes:
        try:
            with self._zip.open(self._infos[member.name]) as handle:
                return handle.read(MAX_MEMBER_BYTES + 1)
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            raise PulsarError(f"{self.origin(member)}: corrupt zip member: {exc}") from None

    def close(self) -> None:
        self._zip.close()


def supported_suffixes() -> list[str]:
    return sorted(_SOURCES)


def open_source(path: str | os.PathLike, field: str) -> Source:
    """Open ``path`` as a calibration source; ``field`` (e.g. ``quant.input_configs[0]``) names it in errors."""
    p = Path(path).expanduser()
    if not str(path):
        raise PulsarError(
            f"{field}.calibration_dataset is empty; set it to a directory, .tar, .tar.gz or .zip"
        )
    if not p.exists():
        raise PulsarError(f"{field}.calibration_dataset: '{path}' does not exist; check the path")
    if p.is_dir():
        return DirSource(p, field)
    lower = p.name.lower()
    # Longest suffix first so 'x.tar.gz' is not taken for a '.gz' file.
    for suffix in sorted(_SOURCES, key=len, reverse=True):
        if lower.endswith(suffix):
            return _SOURCES[suffix](p, field)
    raise PulsarError(
        f"{field}.calibration_dataset: '{path}' is not a directory or a supported archive "
        f"({', '.join(supported_suffixes())})"
    )
