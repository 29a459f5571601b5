"""Console and log output: rich on the terminal, the same text in ``<output_dir>/build.log``.

Two rules hold for everything printed here:

- User text (tensor names, paths, config values) is printed literally: never read as rich markup,
  and control characters (terminal escape sequences, newlines) are shown escaped (``\\x1b``), so a
  name cannot recolour, move or clear the user's terminal. :func:`literal` does it.
- When a stream is not a terminal (CI logs, ``| tee``, ``| grep``) nothing is cut to 80 columns:
  tables are printed at their natural width and log lines are plain text.
"""

from __future__ import annotations

import io
import logging
import re
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from rich.console import Console, RenderableType
from rich.logging import RichHandler
from rich.measure import Measurement
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

console = Console(stderr=True, highlight=False)  # progress, logs, tables of a build: stderr
out_console = Console(highlight=False)  # results and help: stdout
log = logging.getLogger("pulsar")

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_CONTROL_ALL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _escape_char(m: re.Match[str]) -> str:
    c = m.group(0)
    return {"\n": "\\n", "\t": "\\t", "\r": "\\r"}.get(c, f"\\x{ord(c):02x}")


def literal(text: object, *, keep_newlines: bool = False) -> str:
    """``text`` with control characters written out (``\\x1b``, ``\\n``), safe for any terminal.

    Rich markup is not touched here: print the result with ``markup=False`` or inside a ``Text``."""
    pattern = _CONTROL if keep_newlines else _CONTROL_ALL
    return pattern.sub(_escape_char, str(text))


def cell(value: object) -> Text:
    """A table cell that shows ``value`` literally (a ``Text`` keeps its own style)."""
    if isinstance(value, Text):
        return value
    return Text(literal(value))


def print_literal(text: object, *, target: Console | None = None, style: str | None = None) -> None:
    """Print user text as it is: no markup, no highlighting, control characters escaped, no wrapping."""
    (target or console).print(Text(literal(text, keep_newlines=True), style=style or ""), soft_wrap=True,
                              markup=False, highlight=False)


def print_renderable(renderable: RenderableType, *, target: Console | None = None) -> None:
    """Print a table (or any renderable) in full: at its natural width when the stream is not a
    terminal, so piped output is never cut to 80 columns."""
    c = target or console
    if c.is_terminal:
        c.print(renderable)
        return
    width = max(Measurement.get(c, c.options.update(width=100_000), renderable).maximum, 20)
    old = c._width  # rich caps print(width=...) at the console width: widen the console for this print
    try:
        c.width = max(width, c.width)
        c.print(renderable)
    finally:
        c._width = old


class _LiteralFilter(logging.Filter):
    """Escape control characters in every log message (names and paths come from users)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        clean = literal(msg, keep_newlines=True)
        if clean != msg or record.args:
            record.msg, record.args = clean, None
        return True


class _PlainConsoleHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Log lines for a stderr that is not a terminal: one plain line each, never wrapped."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("%(levelname)-8s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr  # follow redirections (tests, CliRunner)
        super().emit(record)


class BuildLog(logging.Handler):
    """The build log: every record and printed table as plain text. It holds what arrives before
    its file can be opened (the build validates everything before it writes anything), then writes
    that and streams the rest."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
        self.addFilter(_LiteralFilter())
        self._pending: list[str] = []
        self._file: Any = None

    def open(self, path: Path) -> None:
        self._file = open(path, "w", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self._file.write("".join(self._pending))
        self._file.flush()
        self._pending = []

    def write_text(self, text: str) -> None:
        if self._file is None:
            self._pending.append(text)
            return
        try:
            self._file.write(text)
            self._file.flush()
        except (OSError, ValueError):  # a full disk must not hide the build's own error
            pass

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.write_text(self.format(record) + "\n")
        except Exception:  # noqa: BLE001 (logging must never raise)
            self.handleError(record)

    def close(self) -> None:
        if self._file is not None:
            with suppress(OSError):
                self._file.close()
            self._file = None
        super().close()


def setup_logging(*, quiet: bool = False, debug: bool = False) -> None:
    """Route the ``pulsar`` logger to the console (idempotent)."""
    log.setLevel(logging.DEBUG)
    for h in list(log.handlers):
        if isinstance(h, (RichHandler, _PlainConsoleHandler)):
            log.removeHandler(h)
    handler: logging.Handler
    if console.is_terminal:
        handler = RichHandler(console=console, show_path=False, show_time=False, markup=False)
    else:
        handler = _PlainConsoleHandler()
    handler.setLevel(logging.DEBUG if debug else (logging.WARNING if quiet else logging.INFO))
    handler.addFilter(_LiteralFilter())  # on the handler: logger filters miss child loggers' records
    log.addHandler(handler)
    log.propagate = False


@contextmanager
def build_log() -> Iterator[BuildLog]:
    """Collect every log record and printed table of a build; ``.open(path)`` starts the file."""
    handler = BuildLog()
    log.addHandler(handler)
    try:
        yield handler
    finally:
        log.removeHandler(handler)
        handler.close()


def _to_log_file(renderable: Any) -> None:
    """Render a rich object as plain text into the build log (not to the terminal)."""
    if not any(isinstance(h, BuildLog) for h in log.handlers):
        return
    # a console wide enough that nothing folds: a table renders at its natural width (one measuring
    # pass inside print, not a separate Measurement.get over every cell first)
    plain = Console(width=100_000, no_color=True, record=True, file=io.StringIO())
    plain.print(renderable)
    text = plain.export_text()
    for h in log.handlers:
        if isinstance(h, BuildLog):
            h.write_text(text)


def show(renderable: Any, *, quiet: bool = False) -> None:
    """A table on the console (in full, see :func:`print_renderable`) and in the build log."""
    if not quiet:
        print_renderable(renderable)
    _to_log_file(renderable)


def plural(n: int, word: str, words: str | None = None) -> str:
    """``1 sample`` / ``2 samples``: counts in messages and progress bars read as English."""
    return f"{n} {word if n == 1 else (words or word + 's')}"


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
    """A table whose cells are shown literally (``Text`` cells keep their style); long values fold
    onto the next line on a narrow terminal instead of being cut with an ellipsis."""
    t = Table(title=Text(literal(title)), title_justify="left", title_style="bold")
    for c in columns:
        t.add_column(Text(literal(c)), overflow="fold")
    for r in rows:
        t.add_row(*[cell(x) for x in r])
    return t


class Stages:
    """Stage headers and per-stage timing for the build summary."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.times: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if not self.quiet:
            if console.is_terminal:
                console.rule(Text(literal(name), style="bold cyan"))
            else:
                print_literal(f"── {name} ──")
        log.debug("stage %s", name)
        t0 = time.perf_counter()
        try:
            yield
        except BaseException:  # a failed stage is not "done": the error line says what happened
            log.debug("%s failed after %.2f s", name, time.perf_counter() - t0)
            raise
        finally:
            self.times[name] = time.perf_counter() - t0
        log.info("%s done in %.2f s", name, self.times[name])

    def progress(self) -> Progress:
        """A progress bar on the console (hidden with --quiet). Descriptions hold user text, so no
        markup; a stderr that is not a terminal gets the final state once, at its natural width."""
        return Progress(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=_progress_console(), disable=self.quiet, transient=False)


def _progress_console() -> Console:
    """The console itself on a terminal; else a console too wide to cut a line (rich draws a bar on a
    file only once, when it stops, and would cut it to 80 columns: ``2…``)."""
    if console.is_terminal:
        return console
    return Console(stderr=True, highlight=False, width=_UNCUT)


_UNCUT = 100_000  # columns: wider than any line, and rich pads nothing to it
