"""Atomic, durable output: a reader never sees a half-written artifact.

Everything pulsar writes goes to a temporary file in the destination directory first; the file is
flushed and fsynced, given the permissions any new file gets under the user's umask (0644 under
umask 022, not the 0600 of a temporary file), and only then renamed into place, and the directory
is fsynced so the rename survives a power cut. An interrupted or failed write leaves the previous
file (or no file), never a truncated one. A write the file system refuses (full disk, read-only,
no permission) is a one-line :class:`PulsarError` naming the file.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import secrets
import threading
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import numpy as np

from pulsar.errors import PulsarError


@cache
def current_umask() -> int:
    """The process umask, read without changing it where /proc allows (changing it is racy)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """Mode of a new regular file under the current umask."""
    return 0o666 & ~current_umask()


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or unlink in ``path`` durable (best effort: some file systems refuse)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_error(path: str | os.PathLike[str], exc: OSError) -> PulsarError:
    """A one-line error for a write the file system refused."""
    reason = exc.strerror or str(exc)
    hint = {errno.ENOSPC: "free some space or choose another output_dir",
            errno.EDQUOT: "free some space or choose another output_dir",
            errno.EROFS: "the file system is read-only: choose another output_dir",
            errno.EACCES: "no permission: choose a directory you can write",
            errno.EPERM: "no permission: choose a directory you can write"}.get(exc.errno or 0, "")
    return PulsarError(f"cannot write {path}: {reason}" + (f"; {hint}" if hint else ""))


# temporary files of writes in progress: an interrupt (Ctrl-C, SIGTERM) can land between any two
# bytecodes, also between creating a temp file and the block that removes it; the CLI's interrupt
# handler removes whatever is still listed here (remove_unfinished)
_LIVE: set[Path] = set()
_LIVE_LOCK = threading.Lock()


def remove_unfinished() -> int:
    """Remove the temporary files of every write still in progress; how many were there."""
    with _LIVE_LOCK:
        left = list(_LIVE)
        _LIVE.clear()
    for p in left:
        with contextlib.suppress(OSError):
            p.unlink()
    return len(left)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; make it durable and rename it onto ``path`` if the
    block succeeds, remove it otherwise. The name is listed in :data:`_LIVE` before the file exists
    and until it is gone, so an interrupt at any point leaves nothing behind (:func:`remove_unfinished`)."""
    dest = Path(path)
    tmp_path = dest.parent / f".{dest.name}.{secrets.token_hex(6)}.tmp"
    with _LIVE_LOCK:
        _LIVE.add(tmp_path)
    try:
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(tmp_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except OSError as exc:
            raise write_error(dest, exc) from None
        try:
            yield tmp_path
            with open(tmp_path, "rb+") as f:
                os.fsync(f.fileno())
            os.chmod(tmp_path, file_mode())
            os.replace(tmp_path, dest)
            fsync_dir(dest.parent)
        except OSError as exc:
            raise write_error(dest, exc) from None
    finally:
        with contextlib.suppress(OSError):
            tmp_path.unlink()
        with _LIVE_LOCK:
            _LIVE.discard(tmp_path)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    with atomic_path(path) as tmp:
        try:
            tmp.write_bytes(data)
        except OSError as exc:
            raise write_error(path, exc) from None
    return Path(path)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_save_npy(path: str | os.PathLike[str], array: np.ndarray) -> Path:
    buf = io.BytesIO()
    np.save(buf, np.asarray(array), allow_pickle=False)
    return atomic_write_bytes(path, buf.getvalue())
