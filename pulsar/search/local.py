"""Trials in local worker processes (``--workers``), a fresh pool after a worker dies.

A worker that dies (killed for memory, or by anything else) breaks the pool: the trials in flight then
are failed rows, what their builds left in ``trials/<k>/`` (staging folder, lock) is removed and their
``trial.json`` written, and a fresh pool takes the rest. Metric plugins cannot end a worker: they run in
a child process of their own (:mod:`pulsar.evaluation.isolated`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from pulsar.search.outdir import clean_dead_trial
from pulsar.search.trial import failed_row, run_trial, write_record

DIED = "its worker process died (killed, e.g. for memory); rerun with fewer --workers"
SKIPPED = "not run: a trial met --target_metric"

Rows = list[dict[str, Any]]


def skipped(jobs: list[dict[str, Any]]) -> Rows:
    return [failed_row(job, SKIPPED, status="skipped") for job in jobs]


def _died(job: dict[str, Any]) -> dict[str, Any]:
    clean_dead_trial(Path(job["dir"]))
    return write_record(job, failed_row(job, DIED))


def run_local(jobs: list[dict[str, Any]], n: int, stop: Callable[[Rows], bool]) -> Iterator[dict[str, Any]]:
    """Rows of ``jobs`` as they finish in ``n`` worker processes; none starts once ``stop(rows so far)``."""
    rows: Rows = []
    queue = list(jobs)
    while queue and not stop(rows):
        pool = ProcessPoolExecutor(max_workers=n, mp_context=get_context("spawn"))
        pending: dict[Future[dict[str, Any]], dict[str, Any]] = {}
        try:
            while queue or pending:
                broken = False
                while queue and len(pending) < n and not stop(rows):
                    try:
                        pending[pool.submit(run_trial, queue[0])] = queue[0]
                    except BrokenProcessPool:  # a worker died since the last wait: this job waits for a new pool
                        broken = True
                        break
                    queue.pop(0)
                if not pending:
                    break
                done = set(pending) if broken else wait(pending, return_when=FIRST_COMPLETED)[0]
                for fut in done:
                    job = pending.pop(fut)
                    try:
                        rows.append(fut.result())
                    except BrokenProcessPool:
                        broken = True
                        rows.append(_died(job))
                    except Exception as exc:  # noqa: BLE001 - a trial that could not even report: still a row
                        rows.append(failed_row(job, f"{type(exc).__name__}: {exc}"))
                    yield rows[-1]
                if broken:  # every trial still in this pool died with it
                    for job in pending.values():
                        rows.append(_died(job))
                        yield rows[-1]
                    pending.clear()
                    break
        except BaseException:  # Ctrl-C / SIGTERM: stop the builds in flight now, not when they finish
            _terminate(pool)
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    yield from skipped(queue)


def _terminate(pool: ProcessPoolExecutor) -> None:
    for proc in list((getattr(pool, "_processes", None) or {}).values()):
        proc.terminate()
