"""SIGTERM handled like Ctrl-C: the build unwinds (temporary files and the staging folder are
removed by the code that made them) and the CLI prints one line and exits with code 2."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType


class Terminated(KeyboardInterrupt):
    """Raised in the main thread when the process receives SIGTERM (or SIGHUP)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise(signum: int, _frame: FrameType | None) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM / SIGHUP raise :class:`Terminated` (a KeyboardInterrupt), so every
    ``finally`` and ``with`` on the way out runs. A no-op outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, _raise) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
