"""``pulsar sweep``: builds over a search space, scored by one metric, with a Pareto report.

Every trial passes the checks a build makes before it writes (config, model, data, metric) before
the first one runs, and the space is counted before it is expanded (:data:`space.MAX_TRIALS`). The
output directory is then locked as a build's is (:mod:`.outdir`). Trials run in local worker processes
(bounded by cores and memory, :mod:`.local`) or on Ray (:mod:`.ray_backend`), share one work directory
(the calibration statistics cache), are resumable (:mod:`.records`: a trial whose ``trial.json`` holds
the same settings and fingerprint and succeeded is not rebuilt) and never stop the sweep when they
fail, even when their worker process dies."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pulsar.errors import PulsarError
from pulsar.search.local import run_local, skipped
from pulsar.search.outdir import SweepLock, check_links
from pulsar.search.records import fingerprint, previous
from pulsar.search.report import write_report
from pulsar.search.space import check_trials, load_space, trials
from pulsar.utils.outdir import check_dir_path

log = logging.getLogger(__name__)
GIB_PER_TRIAL = 2  # a build's working set on the example models, for the memory bound on workers

__all__ = ["sweep"]


def _workers(requested: int | None, n: int) -> int:
    from pulsar.preflight import available_memory

    cores = os.cpu_count() or 1
    free = available_memory()
    by_memory = max(1, free // (GIB_PER_TRIAL << 30)) if free else cores
    return max(1, min(requested or cores, cores, by_memory, n))


def _metric_of(config: str | Path | dict[str, Any] | None, input: str | Path, out: Path, metric: str | None) -> str:
    from pulsar.config import load_build_config

    base = load_build_config(config, {"input": str(input), "output_dir": str(out)}).cfg
    name = metric or base.evaluation.metric
    if not name:
        raise PulsarError("a sweep needs a metric: pass --metric (a built-in name or module:function) or set "
                          "evaluation.metric in the base config")
    target, sep, fn = str(name).rpartition(":")
    if sep and target.endswith(".py"):  # workers (Ray ones included) may run elsewhere: an absolute file
        return f"{Path(target).absolute()}:{fn}"
    return str(name)


def _preflight(config: str | Path | dict[str, Any] | None, settings: list[dict[str, Any]], fixed: dict[str, Any], out: Path,
               metric_flag: bool) -> list[Any]:
    """Each trial through the checks a build makes before it writes; returns their effective configs.
    A mistake every trial shares is reported plainly, one of a trial's own settings with the trial."""
    from pulsar.api import check_build

    def check(k: int) -> Any:
        try:
            return check_build(config, {**fixed, **settings[k], "output_dir": str(out / "trials" / str(k))})
        except PulsarError as exc:
            text = str(exc)
            if metric_flag and text.startswith("evaluation.metric:"):
                text = "--metric:" + text.removeprefix("evaluation.metric:")
            return PulsarError(text)

    effs = []
    for k, s in enumerate(settings):
        if k == 1:
            logging.disable(logging.WARNING)  # the same warnings as trial 0's: shown once
        try:
            eff = check(k)
            if isinstance(eff, PulsarError):
                other = check(1 if k == 0 else 0) if len(settings) > 1 else eff
                if isinstance(other, PulsarError) and str(other) == str(eff):
                    raise eff  # every trial would hit it
                shown = ", ".join(f"{f}={v!r}" for f, v in s.items())
                raise PulsarError(f"trial {k} ({shown}): {eff}")
        finally:
            logging.disable(logging.NOTSET)
        effs.append(eff)
    return effs


def _check_options(workers: int | None, ray: str | None, target_metric: float | None) -> None:
    """The command-line values alone, before any file is read."""
    if workers is not None and workers < 1:
        raise PulsarError(f"--workers must be at least 1, got {workers}")
    if target_metric is not None and (isinstance(target_metric, bool) or not isinstance(target_metric, int | float)
                                      or not math.isfinite(target_metric)):
        raise PulsarError(f"--target_metric: {target_metric!r} is not a finite number; give the metric value a trial "
                          "must reach, e.g. 0.75")
    if ray is not None:
        if workers is not None:
            raise PulsarError("--workers sets local worker processes; with --ray, Ray schedules one trial per free "
                              "CPU of the cluster: drop --workers")
        from pulsar.search.ray_backend import check_address, require_ray

        require_ray()
        check_address(ray)


def sweep(input: str | Path, config: str | Path | dict[str, Any] | None, space: str | Path,
          output_dir: str | Path, *, metric: str | None = None, workers: int | None = None,
          ray: str | None = None, target_metric: float | None = None, quiet: bool = False) -> list[dict[str, Any]]:
    """Run the sweep; returns the trial table (the ``trials`` of ``sweep.json``). ``ray``: a Ray address
    ("" or "local" starts a local instance) to run the trials on instead of local processes.

    Everything is checked before anything is written (the options, the space and every trial's build
    checks, links in the output directory); then the sweep holds the output directory's lock."""
    from pulsar.ui import setup_logging

    setup_logging(quiet=quiet)
    _check_options(workers, ray, target_metric)
    # absolute paths: every worker (a Ray node included) resolves them alike, and the work dir stays in OUT
    out, input = Path(output_dir).absolute(), Path(input).absolute()
    if isinstance(config, str | Path):
        config = Path(config).absolute()
    name = _metric_of(config, input, out, metric)
    settings = trials(load_space(space), space)
    fixed: dict[str, Any] = {"input": str(input), "work_dir": str(out / "work"), "evaluation.metric": name}
    check_trials(config, settings, {**fixed, "output_dir": str(out / "trials" / "0")}, space)
    check_dir_path(out, "--output_dir")
    check_links(out, len(settings))
    prints = [fingerprint(e, name, input) for e in _preflight(config, settings, fixed, out, metric is not None)]
    cfg = str(config) if isinstance(config, Path) else config
    jobs: list[dict[str, Any]] = [{"trial": k, "settings": s, "dir": str(out / "trials" / str(k)), "input": str(input),
                                   "config": cfg, "fixed": fixed, "fingerprint": prints[k]}
                                  for k, s in enumerate(settings)]
    with SweepLock(out):
        table = _run(jobs, name, workers, ray, target_metric)
        write_report(out, table, name, _best(table, target_metric))
    return table


def _run(jobs: list[dict[str, Any]], name: str, workers: int | None, ray: str | None,
         target_metric: float | None) -> list[dict[str, Any]]:
    """Every job's row: resumed from its record, or run (locally or on Ray) unless the target was met."""
    from pulsar.utils.signals import terminate_as_interrupt

    rows: dict[int, dict[str, Any]] = {}
    todo = []
    for job in jobs:
        prev = previous(Path(job["dir"]) / "trial.json", job["trial"], job["settings"], job["fingerprint"])
        if prev is not None:
            rows[job["trial"]] = prev
        else:
            todo.append(job)
    log.info("sweep: %d trials (%d done before, resumed), metric %s", len(jobs), len(rows), name)
    done_before = list(rows.values())

    def stop(new_rows: list[dict[str, Any]]) -> bool:
        return _met(done_before + new_rows, target_metric)

    with terminate_as_interrupt():
        if todo and stop([]):
            results: Iterator[dict[str, Any]] = iter(skipped(todo))
        elif todo and ray is not None:
            from pulsar.search.ray_backend import run_on_ray

            results = run_on_ray(todo, ray, stop)
        else:
            n = _workers(workers, len(todo))
            threads = max(1, (os.cpu_count() or 1) // n)
            log.info("sweep: %d local worker processes, %d thread(s) each", n, threads)
            results = run_local([{**job, "threads": threads} for job in todo], n, stop)
        for row in results:
            rows[row["trial"]] = row
            log.info("trial %d/%d %s: %s %s, %s ms%s", row["trial"], len(jobs), row["status"], name,
                     row.get("metric"), row.get("latency_ms"), f" ({row['error']})" if row.get("error") else "")
    return [rows[k] for k in sorted(rows)]


def _met(rows: Any, target: float | None) -> bool:
    return target is not None and any(r["status"] == "ok" and r["metric"] >= target for r in rows)


def _best(rows: list[dict[str, Any]], target: float | None) -> int | None:
    """The fastest finished trial meeting ``target`` (None without a target or when none meets it)."""
    if target is None:
        return None
    ok = [r for r in rows if r["status"] == "ok" and r["metric"] >= target and r["latency_ms"] is not None]
    return min(ok, key=lambda r: (r["latency_ms"], -r["metric"]))["trial"] if ok else None
