"""Console and log output: rich on the terminal, the same text in ``<output_dir>/build.log``."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

console = Console(stderr=True, highlight=False)
log = logging.getLogger("pulsar")


class _PlainFileHandler(logging.FileHandler):
    def __init__(self, path: Path):
        super().__init__(path, mode="w", encoding="utf-8")
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))


def setup_logging(*, quiet: bool = False, debug: bool = False) -> None:
    """Route the ``pulsar`` logger to the console (idempotent)."""
    log.setLevel(logging.DEBUG)
    for h in list(log.handlers):
        if isinstance(h, RichHandler):
            log.removeHandler(h)
    handler = RichHandler(console=console, show_path=False, show_time=False, markup=False)
    handler.setLevel(logging.DEBUG if debug else (logging.WARNING if quiet else logging.INFO))
    log.addHandler(handler)
    log.propagate = False


@contextmanager
def log_file(path: Path) -> Iterator[None]:
    """Mirror every log record and printed table into ``path`` for the duration of a build."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = _PlainFileHandler(path)
    handler.setLevel(logging.DEBUG)
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)
        handler.close()


def _to_log_file(renderable: Any) -> None:
    """Render a rich object as plain text into the build log (not to the terminal)."""
    plain = Console(width=160, no_color=True, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    plain.print(renderable)
    text = plain.export_text()
    plain.file.close()
    for h in log.handlers:
        if isinstance(h, _PlainFileHandler):
            h.stream.write(text)
            h.flush()


def show(renderable: Any, *, quiet: bool = False) -> None:
    if not quiet:
        console.print(renderable)
    _to_log_file(renderable)


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
    t = Table(title=title, title_justify="left", title_style="bold")
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*[str(x) for x in r])
    return t


class Stages:
    """Stage headers and per-stage timing for the build summary."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.times: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if not self.quiet:
            console.rule(f"[bold cyan]{name}")
        log.debug("stage %s", name)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.times[name] = time.perf_counter() - t0
            log.info("%s done in %.2f s", name, self.times[name])

    def progress(self) -> Progress:
        """A progress bar on the console (hidden with --quiet)."""
        return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, disable=self.quiet, transient=False)
