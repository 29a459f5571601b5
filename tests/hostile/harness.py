"""Shared checks for the hostile-input corpus.

Every case runs the real ``pulsar`` command in a process of its own (tests/cli_fork.py), in a directory of its own, and asserts
what the README promises of a failure: exit code 2, exactly one ``error:`` line that names the
problem, no traceback, and no file created or changed anywhere in the case directory (so nothing
outside the output dir either, and no new artifact or temp file inside it).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.cli_fork import run_pulsar

# A failed build may leave the log of the attempt and the calibration statistics cache (keyed by
# content, so it cannot mix builds); nothing else.
ALLOWED_AFTER_FAILURE = ("build_failed.log", "cache/")


@dataclass(frozen=True)
class Case:
    """One hostile input: ``setup(case_dir, env)`` makes its files and returns the command line (what
    it makes belongs to the "before" state); the one error line must contain ``needle``."""

    id: str
    setup: Callable[[Path, Any], list[str]]
    needle: str | tuple[str, ...]


@dataclass(frozen=True)
class Snapshot:
    files: dict[str, tuple[int, int]]  # relative path -> (size, mtime_ns)

    @classmethod
    def of(cls, root: Path) -> Snapshot:
        files: dict[str, tuple[int, int]] = {}
        for dirpath, _dirs, names in os.walk(root):
            for name in names:
                p = Path(dirpath) / name
                try:
                    st = p.lstat()
                except OSError:
                    continue
                files[p.relative_to(root).as_posix()] = (st.st_size, st.st_mtime_ns)
        return cls(files)


def run_cli(args: list[str], cwd: Path, *, env: dict[str, str] | None = None, timeout: float = 120,
            stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m pulsar ARGS`` in ``cwd`` with a wide, non-terminal console (a process of its own, forked
    from a warm interpreter: tests/cli_fork.py)."""
    full_env = {**os.environ, "COLUMNS": "400", **(env or {})}
    return run_pulsar(args, cwd, env=full_env, timeout=timeout, stdin=stdin, errors="replace")


def error_lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]


def new_files(before: Snapshot, after: Snapshot, out_rel: str = "out") -> list[str]:
    """Files created or changed since ``before``, less what a failure may leave in ``out_rel``."""
    changed = [p for p, meta in after.files.items() if before.files.get(p) != meta]
    allowed = tuple(f"{out_rel}/{a}" for a in ALLOWED_AFTER_FAILURE)
    return sorted(p for p in changed if not p.startswith(allowed))


def assert_clean_failure(proc: subprocess.CompletedProcess[str], needle: str | tuple[str, ...],
                         before: Snapshot | None = None, root: Path | None = None,
                         out_rel: str = "out") -> None:
    """Exit 2, one ``error:`` line containing ``needle`` (every part of a tuple), no traceback, and
    nothing new under ``root`` since ``before``."""
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text
    assert "Traceback" not in text, text
    lines = error_lines(proc)
    assert len(lines) == 1, text
    for part in (needle,) if isinstance(needle, str) else needle:
        assert part in lines[0], f"{part!r} not in {lines[0]!r}"
    if before is not None and root is not None:
        left = new_files(before, Snapshot.of(root), out_rel)
        assert not left, f"files left behind: {left}\n{text}"
        assert not [p for p in Snapshot.of(root).files if p.endswith(".tmp")], text


def run_case(root: Path, env: Any, case: Case) -> tuple[Case, subprocess.CompletedProcess[str], Snapshot, Path]:
    """Make ``case``'s directory under ``root``, set it up, snapshot it and run its command there."""
    d = root / case.id
    d.mkdir()
    argv = case.setup(d, env)
    before = Snapshot.of(d)
    return case, run_cli(argv, d), before, d
