"""``pulsar sweep``: builds over a search space, scored by one metric, with a Pareto report.

Trials run in local worker processes (bounded by cores and memory), share one work directory (so
the calibration statistics are computed once), are resumable (a trial whose ``trial.json`` holds the
same settings and succeeded is not rebuilt) and never stop the sweep when they fail."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from pulsar.errors import PulsarError
from pulsar.search.report import write_report
from pulsar.search.space import check_trials, load_space, trials
from pulsar.search.trial import run_trial

log = logging.getLogger(__name__)
GIB_PER_TRIAL = 2  # a build's working set on the example models, for the memory bound on workers

__all__ = ["sweep"]


def _workers(requested: int | None, n: int) -> int:
    from pulsar.preflight import available_memory

    cores = os.cpu_count() or 1
    if requested is not None and requested < 1:
        raise PulsarError(f"--workers must be at least 1, got {requested}")
    free = available_memory()
    by_memory = max(1, free // (GIB_PER_TRIAL << 30)) if free else cores
    return max(1, min(requested or cores, cores, by_memory, n))


def _metric_of(config: Any, input: str | Path, out: Path, metric: str | None) -> str:
    from pulsar.config import load_build_config

    base = load_build_config(config, {"input": str(input), "output_dir": str(out)}).cfg
    name = metric or base.evaluation.metric
    if not name:
        raise PulsarError("a sweep needs a metric: pass --metric (a built-in name or module:function) or set "
                          "evaluation.metric in the base config")
    return str(name)


def _previous(path: Path, settings: dict[str, Any]) -> dict[str, Any] | None:
    try:
        row = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if row.get("settings") != settings or row.get("status") != "ok":
        return None
    return dict(row, resumed=True)


def sweep(input: str | Path, config: str | Path | dict[str, Any] | None, space: str | Path,
          output_dir: str | Path, *, metric: str | None = None, workers: int | None = None,
          ray: str | None = None, target_metric: float | None = None, quiet: bool = False) -> list[dict[str, Any]]:
    """Run the sweep; returns the trial table (the ``trials`` of ``sweep.json``). ``ray``: a Ray address
    ("" or "local" starts a local instance) to run the trials on instead of local processes."""
    from pulsar.ui import setup_logging

    setup_logging(quiet=quiet)
    out = Path(output_dir)
    if ray is not None:
        from pulsar.search.ray_backend import require_ray

        require_ray()
    name = _metric_of(config, input, out, metric)
    settings = trials(load_space(space))
    fixed: dict[str, Any] = {"input": str(input), "work_dir": str(out / "work"), "evaluation.metric": name}
    check_trials(config, settings, {**fixed, "output_dir": str(out / "trials" / "0")}, space)
    if name and ":" in name:
        from pulsar.evaluation.plugins import load_metric

        load_metric(name, "--metric")
    cfg = str(config) if isinstance(config, str | Path) else config
    jobs: list[dict[str, Any]] = [{"trial": k, "settings": s, "dir": str(out / "trials" / str(k)),
                                   "input": str(input), "config": cfg, "fixed": fixed} for k, s in enumerate(settings)]
    rows: dict[int, dict[str, Any]] = {}
    todo = []
    for job in jobs:
        prev = _previous(Path(job["dir"]) / "trial.json", job["settings"])
        if prev is not None:
            rows[job["trial"]] = prev
        else:
            todo.append(job)
    log.info("sweep: %d trials (%d done before, resumed), metric %s", len(jobs), len(rows), name)
    done_before = list(rows.values())

    def stop(new_rows: list[dict[str, Any]]) -> bool:
        return _met(done_before + new_rows, target_metric)

    if todo and not stop([]):
        if ray is not None:
            from pulsar.search.ray_backend import run_on_ray

            results = run_on_ray(todo, ray, stop)
        else:
            results = _run_local(todo, _workers(workers, len(todo)), stop)
        for row in results:
            rows[row["trial"]] = row
            log.info("trial %d/%d %s: %s %s, %s ms", row["trial"], len(jobs), row["status"], name,
                     row.get("metric"), row.get("latency_ms"))
    table = [rows[k] for k in sorted(rows)]
    best = _best(table, target_metric)
    write_report(out, table, name, best)
    return table


def _run_local(jobs: list[dict[str, Any]], n: int, stop: Callable[[list[dict[str, Any]]], bool]
               ) -> Iterator[dict[str, Any]]:
    """Rows of ``jobs`` as they finish in ``n`` worker processes; none starts once ``stop(rows so far)``."""
    rows: list[dict[str, Any]] = []
    with ProcessPoolExecutor(max_workers=n, mp_context=get_context("spawn")) as pool:
        pending: dict[Future[dict[str, Any]], dict[str, Any]] = {}
        queue = list(jobs)
        while queue or pending:
            while queue and len(pending) < n and not stop(rows):
                job = queue.pop(0)
                pending[pool.submit(run_trial, job)] = job
            if not pending:
                break
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                pending.pop(fut)
                rows.append(fut.result())
                yield rows[-1]
    for job in queue:
        yield {"trial": job["trial"], "settings": job["settings"], "status": "skipped", "metric": None,
               "latency_ms": None, "size_bytes": None, "build_s": None, "error": "not run: a trial met --target-metric"}


def _met(rows: Any, target: float | None) -> bool:
    return target is not None and any(r["status"] == "ok" and r["metric"] >= target for r in rows)


def _best(rows: list[dict[str, Any]], target: float | None) -> int | None:
    """The fastest finished trial meeting ``target`` (None without a target or when none meets it)."""
    if target is None:
        return None
    ok = [r for r in rows if r["status"] == "ok" and r["metric"] >= target and r["latency_ms"] is not None]
    return min(ok, key=lambda r: (r["latency_ms"], -r["metric"]))["trial"] if ok else None
