"""The sweep's output directory: locked as a build locks its own, never left through a link, and
cleaned after a trial whose worker died.

- **Locked**: ``<output_dir>/.pulsar.lock``, the build's lock (:class:`pulsar.utils.outdir.BuildOutput`),
  is held for the whole sweep, so a second sweep (or a build) into the same directory fails at once
  naming the running one, instead of both writing the same trials and leaving ``sweep.json`` at odds
  with the ``trial.json`` files.
- **No links**: before anything is written, every path the sweep and its builds write (``trials/``,
  each ``trials/<k>/`` and what is in it, ``work/``, the report files) must not be a symbolic link: a
  link would carry the writes out of the output directory.
- **Cleaned**: a build whose process was killed leaves its staging folder and its lock file (no longer
  held) in ``trials/<k>/``; they are removed, so a dead trial leaves only its failed row.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from pathlib import Path

from pulsar.errors import PulsarError
from pulsar.utils.atomic import write_error
from pulsar.utils.outdir import LOCK_NAME, STAGING_PREFIX, BuildOutput

REPORT = ("sweep.json", "sweep.png", "sweep.html")


class SweepLock(BuildOutput):
    """The build's lock on the sweep's directory, without a staging folder: the sweep writes its report
    in place (each file atomically) and every trial builds in its own locked folder."""

    def __enter__(self) -> SweepLock:
        self._make_dirs()
        try:
            self._lock()
        except PulsarError as exc:
            self._release()
            text = str(exc)
            raise PulsarError("--" + text if text.startswith("output_dir:") else text) from None
        except OSError as exc:
            self._release()
            raise write_error(self.final, exc) from None
        except BaseException:
            self._release()
            raise
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._release()


def check_links(out: Path, trials: int) -> None:
    """No symbolic link where the sweep or a trial's build would write (checked before writing)."""
    if not out.is_dir():
        return
    paths = [out / name for name in ("trials", "work", LOCK_NAME, *REPORT)]
    paths += [out / "trials" / str(k) for k in range(trials)]
    for path in paths:
        _refuse_link(path)
    for root in (out / "trials", out / "work"):
        for folder, dirs, files in os.walk(root):  # links are listed, never followed
            for name in dirs + files:
                _refuse_link(Path(folder) / name)


def _refuse_link(path: Path) -> None:
    if path.is_symlink():
        try:
            to = os.readlink(path)
        except OSError:
            to = "?"
        raise PulsarError(f"--output_dir: {path} is a symbolic link (to {to}); a sweep writes only inside its output "
                          "directory and follows no link: remove the link or choose another --output_dir")


DEAD_LOCK_WAIT_S = 5.0


def clean_dead_trial(folder: Path) -> None:
    """Remove what a killed build left in ``folder``: its staging folders and its lock file, once the lock
    is free (a live holder keeps both)."""
    lock = folder / LOCK_NAME
    fd = None
    if lock.exists() or lock.is_symlink():
        try:
            fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            return
        # the pool sees a killed worker die when its pipe closes, which the kernel may do a moment
        # before it closes the worker's lock (seen on a loaded machine): wait briefly for the lock
        deadline = time.monotonic() + DEAD_LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    return
                time.sleep(0.05)
    try:
        for staging in folder.glob(f"{STAGING_PREFIX}*"):
            shutil.rmtree(staging, ignore_errors=True)
        if fd is not None:
            with contextlib.suppress(OSError):
                lock.unlink()
    finally:
        if fd is not None:
            os.close(fd)
