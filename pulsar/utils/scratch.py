"""Where a build may put scratch files: inside its own staging folder, never the system temp dir
(nothing is written outside the output directory)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path

_SCRATCH: ContextVar[Path | None] = ContextVar("pulsar_scratch", default=None)


def scratch_dir() -> str | None:
    """The current build's scratch folder (None outside a build: the caller's default applies)."""
    path = _SCRATCH.get()
    return str(path) if path is not None else None


@contextlib.contextmanager
def use_scratch(path: Path) -> Iterator[None]:
    token = _SCRATCH.set(path)
    try:
        yield
    finally:
        _SCRATCH.reset(token)
