"""Progress bars for the long loops of a build (per sample, per layer, per trial).

Algorithms take a plain ``progress(done)`` callback (``done``: items finished so far), so they stay
free of the console; the stage opens the bar with :func:`progress_tasks` on ``ctx.stages.progress()``
(stderr, hidden with --quiet). Only one bar can be live at a time, so a step made of several loops
(the mixed-precision search: ranking, then trials) adds its tasks to the one bar.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")
Progress = Callable[[int], None]


class Task:
    """One line of a bar: ``task(done)`` moves it; ``finish()`` ends it where it stands (a search that
    stops early does not leave the bar short of its total)."""

    def __init__(self, bar: Any, description: str, total: int | None):
        self._bar, self._id = bar, bar.add_task(description, total=total)
        self.done = 0

    def __call__(self, done: int) -> None:
        self.done = done
        self._bar.update(self._id, completed=done)

    def finish(self) -> None:
        self._bar.update(self._id, total=self.done, completed=self.done)


NewTask = Callable[[str, "int | None"], Task]


@contextmanager
def progress_tasks(stages: Any) -> Iterator[NewTask]:
    """Yield ``new_task(description, total)`` on one bar of ``stages`` (a :class:`pulsar.ui.Stages`)."""
    with stages.progress() as bar:
        yield lambda description, total: Task(bar, description, total)


@contextmanager
def progress_task(stages: Any, description: str, total: int | None) -> Iterator[Task]:
    """A bar with one task."""
    with progress_tasks(stages) as new_task:
        yield new_task(description, total)


def counted(items: Iterable[T], progress: Progress | None) -> Iterator[T]:
    """``items`` as they are, calling ``progress(k)`` once the k-th has been used."""
    done = 0
    for item in items:  # not enumerate(): its reused tuple would keep the last sample alive
        yield item
        done += 1  # noqa: SIM113
        if progress is not None:
            progress(done)
