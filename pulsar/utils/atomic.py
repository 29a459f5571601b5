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
from concurrent.futures import Future, ThreadPoolExecutor
from contextvars import ContextVar
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


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, background: bool = False) -> Path:
    """Write ``data`` to ``path`` atomically. ``background``: inside :func:`background_writes`, hand
    the write to its thread and return at once (outside one, write now)."""
    writer = _WRITER.get() if background else None
    if writer is not None:
        writer.submit(Path(path), data)
        return Path(path)
    with atomic_path(path) as tmp:
        try:
            tmp.write_bytes(data)
        except OSError as exc:
            raise write_error(path, exc) from None
    return Path(path)


# ----------------------------------------------------------------------------- background writes
class _Writer:
    """One thread that writes large artifacts while the build goes on: writing and fsyncing release
    the GIL, so a 90 MB model reaches the disk (0.05-0.17 s) while the next stage computes. The bytes
    of a write in flight stay readable (:func:`pending_bytes`) until the file is in place."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pulsar-write")
        self._futures: list[Future[Path | None]] = []
        self._pending: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._closing = False  # the block failed: a write not yet begun never begins

    def submit(self, path: Path, data: bytes) -> None:
        key = os.path.abspath(path)
        with self._lock:
            self._pending[key] = data
        self._futures.append(self._pool.submit(self._write, path, key, data))

    def _write(self, path: Path, key: str, data: bytes) -> Path | None:
        try:
            if self._closing:  # the caller is cleaning up: no folder may be created again
                return None
            return atomic_write_bytes(path, data)
        finally:
            with self._lock:
                if self._pending.get(key) is data:
                    del self._pending[key]

    def pending(self, path: str | os.PathLike[str]) -> bytes | None:
        """The bytes of a write to ``path`` still under way; None once it is in place (or for a path
        never handed over). A write that failed raises its own error here, not the reader's."""
        with self._lock:
            data = self._pending.get(os.path.abspath(path))
        if data is None:
            self.poll()
        return data

    def poll(self) -> None:
        """Raise the failure of a write that has ended, without waiting for the others."""
        for future in [f for f in self._futures if f.done()]:
            self._futures.remove(future)
            future.result()

    def settle(self) -> None:
        """Wait for every write handed over so far; raise the first one's failure."""
        futures, self._futures = self._futures, []
        errors = [f.exception() for f in futures]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def close(self, *, raise_errors: bool) -> None:
        """End the thread. After a failure (``raise_errors`` false) the writes not begun are dropped and
        the one under way is waited for, through further interrupts too: the caller removes the
        staging folder next, and nothing may write into it afterwards."""
        try:
            if raise_errors:
                self.settle()
        finally:
            if not raise_errors:
                self._closing = True
            while True:
                try:
                    self._pool.shutdown(wait=True, cancel_futures=not raise_errors)
                    break
                except KeyboardInterrupt:  # a second Ctrl-C: the write under way still ends first (< 1 s)
                    self._closing = True
                    continue


_WRITER: ContextVar[_Writer | None] = ContextVar("pulsar_background_writer", default=None)


@contextlib.contextmanager
def background_writes() -> Iterator[None]:
    """Within the block, ``atomic_write_bytes(..., background=True)`` writes on a thread of its own.
    Leaving the block waits for every write; the first failure is raised then, unless the block
    itself raised (that error, or the interrupt, stays the one reported). Readers of an artifact
    written this way call :func:`settle_writes` first, or read :func:`pending_bytes`."""
    writer = _Writer()
    token = _WRITER.set(writer)
    try:
        yield
    except BaseException:
        writer.close(raise_errors=False)
        raise
    else:
        writer.close(raise_errors=True)
    finally:
        _WRITER.reset(token)


def settle_writes(*, wait: bool = True) -> None:
    """Wait for the background writes so far (see :func:`background_writes`); raise the first failure.
    ``wait=False``: only raise the failure of a write that has already ended (a stage boundary)."""
    writer = _WRITER.get()
    if writer is not None:
        if wait:
            writer.settle()
        else:
            writer.poll()


def pending_bytes(path: str | os.PathLike[str]) -> bytes | None:
    """The content of a background write to ``path`` that is not in place yet, else None (read the
    file); a background write that failed raises its error here."""
    writer = _WRITER.get()
    return writer.pending(path) if writer is not None else None



def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_save_npy(path: str | os.PathLike[str], array: np.ndarray) -> Path:
    buf = io.BytesIO()
    np.save(buf, np.asarray(array), allow_pickle=False)
    return atomic_write_bytes(path, buf.getvalue())
