"""The output directory of a build: checked, locked, staged, and committed only on success.

- **Checked first**: ``output_dir`` (and ``work_dir``) must be a directory or creatable as one
  (no parent that is a file, not under /proc or /sys); this is decided from the path alone, before
  anything is written.
- **Locked**: ``<output_dir>/.pulsar.lock`` is held (``flock``) for the whole build, so a second
  build into the same directory fails at once with a message naming the running one (its pid,
  start time and command line), instead of mixing artifacts. The lock file is removed at the end.
- **Staged**: every artifact is written into ``<output_dir>/.pulsar-staging-<pid>/``; on success
  the new artifacts replace the old ones (whole ``frontend/``, ``quant/``, ``compiler/`` folders,
  so no stale file of an earlier build survives next to new ones). On failure the staging folder
  is removed and the previous build's artifacts are untouched; the log of the failed attempt is
  kept as ``build_failed.log``. A directory the build had to create is removed again if nothing
  is left in it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pulsar.errors import PulsarError
from pulsar.utils.atomic import fsync_dir, write_error

LOCK_NAME = ".pulsar.lock"
STAGING_PREFIX = ".pulsar-staging-"
FAILED_LOG = "build_failed.log"
_VIRTUAL_FS = ("/proc", "/sys", "/dev")


def check_dir_path(path: Path, flag: str) -> None:
    """``path`` is a directory or could be created as one; decided without writing anything."""
    text = str(path)
    if not text:
        raise PulsarError(f"{flag}: empty path; give a directory")
    resolved = Path(os.path.abspath(path))
    for root in _VIRTUAL_FS:
        if resolved == Path(root) or str(resolved).startswith(root + "/"):
            raise PulsarError(f"{flag}: '{path}' is inside {root}, a virtual file system; choose a normal directory")
    if path.exists() and not path.is_dir():
        raise PulsarError(f"{flag}: '{path}' exists and is not a directory; choose another path")
    probe = resolved
    while not probe.exists():
        if probe.is_symlink():  # a dangling link on the way
            raise PulsarError(f"{flag}: '{probe}' is a broken symbolic link; fix it or choose another path")
        probe = probe.parent
    if not probe.is_dir():
        raise PulsarError(f"{flag}: cannot create '{path}': '{probe}' is a file, not a directory")
    if os.statvfs(probe).f_flag & os.ST_RDONLY:
        raise PulsarError(f"{flag}: cannot create or write '{path}': '{probe}' is on a read-only file system; "
                          "choose another directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise PulsarError(f"{flag}: cannot create or write '{path}': no permission in '{probe}'")


@dataclass
class BuildOutput:
    """Lock + staging folder of one build into ``final``; use as a context manager."""

    final: Path
    command: str = field(default_factory=lambda: " ".join(sys.argv))
    staging: Path = field(init=False)
    _lock_fd: int | None = field(default=None, init=False)
    _created: list[Path] = field(default_factory=list, init=False)

    # -- set up ----------------------------------------------------------------------------------
    def __enter__(self) -> BuildOutput:
        self._make_dirs()
        try:
            self._lock()
            self._remove_stale_staging()
            self.staging = self.final / f"{STAGING_PREFIX}{os.getpid()}"
            if self.staging.exists():
                shutil.rmtree(self.staging)
            self.staging.mkdir()
        except OSError as exc:
            self._release()
            raise write_error(self.final, exc) from None
        except BaseException:
            self._release()
            raise
        return self

    def _make_dirs(self) -> None:
        missing: list[Path] = []
        p = self.final
        while not p.exists():
            missing.append(p)
            p = p.parent
        for d in reversed(missing):
            try:
                d.mkdir()
            except FileExistsError:
                continue
            except OSError as exc:
                self._remove_created()
                raise PulsarError(f"output_dir: cannot create '{d}': {exc.strerror}; choose a directory you can "
                                  "write") from None
            self._created.append(d)

    def _lock(self) -> None:
        path = self.final / LOCK_NAME
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise PulsarError(f"output_dir: cannot write in '{self.final}': {exc.strerror}; choose a directory "
                                  "you can write") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise PulsarError(f"output_dir: '{self.final}' is in use by another pulsar build "
                                      f"({_describe_holder(path)}); wait for it to finish or choose another "
                                      "--output_dir") from None
                raise
            try:  # the holder may have removed the file between our open and our lock: retry then
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                "command": self.command}
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(info).encode())
        self._lock_fd = fd

    def _remove_stale_staging(self) -> None:
        """Staging folders of builds that were killed (SIGKILL, power cut): we hold the lock, so
        none of them belongs to a running build."""
        for p in self.final.glob(f"{STAGING_PREFIX}*"):
            shutil.rmtree(p, ignore_errors=True)

    # -- finish ----------------------------------------------------------------------------------
    def commit(self) -> None:
        """Move the staged artifacts into place, replacing the previous build's."""
        previous_name = _previous_output_name(self.final)
        new_entries = sorted(p.name for p in self.staging.iterdir())
        try:
            for name in new_entries:
                dest = self.final / name
                if dest.is_dir() and not dest.is_symlink():
                    trash = self.staging.with_name(self.staging.name + "-old")
                    os.replace(dest, trash)
                    shutil.rmtree(trash, ignore_errors=True)
                os.replace(self.staging / name, dest)
            stale = [FAILED_LOG] + ([previous_name] if previous_name and previous_name not in new_entries else [])
            for name in stale:
                with contextlib.suppress(OSError):
                    (self.final / name).unlink()
            fsync_dir(self.final)
        except OSError as exc:
            raise write_error(self.final, exc) from None
        self._created.clear()  # the build succeeded: what it created stays

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            if self.staging.exists():
                log = self.staging / "build.log"
                if exc_type is not None and log.exists():
                    with contextlib.suppress(OSError):
                        os.replace(log, self.final / FAILED_LOG)
                shutil.rmtree(self.staging, ignore_errors=True)
        finally:
            self._release()

    def _release(self) -> None:
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.final / LOCK_NAME)
            os.close(self._lock_fd)
            self._lock_fd = None
        self._remove_created()

    def _remove_created(self) -> None:
        """Directories this build created and that hold nothing: a failed build leaves no trace."""
        for d in reversed(self._created):
            with contextlib.suppress(OSError):
                d.rmdir()  # only if empty
        self._created = [d for d in self._created if d.exists()]


def _describe_holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "it is starting"
    return f"pid {info.get('pid')} on {info.get('host')}, started {info.get('started')}: {info.get('command')}"


def _previous_output_name(final: Path) -> str | None:
    """The compiled model's file name in the previous build (its build_config.json says)."""
    try:
        name = json.loads((final / "build_config.json").read_text()).get("output_name")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) and name and "/" not in name and name not in ("..", ".") else None
