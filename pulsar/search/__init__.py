"""``pulsar sweep``: builds over a search space, scored by one metric, with a Pareto report.

Every trial passes the checks a build makes before it writes (config, model, data, metric) before
the first one runs. Trials run in local worker processes (bounded by cores and memory), share one
work directory (the calibration statistics cache), are resumable (a trial whose ``trial.json`` holds
the same settings and fingerprint and succeeded is not rebuilt) and never stop the sweep when they
fail, even when their worker process dies."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from pulsar.errors import PulsarError
from pulsar.search.report import write_report
from pulsar.search.space import check_trials, load_space, trials
from pulsar.search.trial import failed_row, run_trial
from pulsar.utils.outdir import check_dir_path

log = logging.getLogger(__name__)
GIB_PER_TRIAL = 2  # a build's working set on the example models, for the memory bound on workers
DIED = ("its worker process died (killed, e.g. for memory, or the metric ended the process); rerun with fewer "
        "--workers")

__all__ = ["sweep"]


def _workers(requested: int | None, n: int) -> int:
    from pulsar.preflight import available_memory

    cores = os.cpu_count() or 1
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
    target, sep, fn = str(name).rpartition(":")
    if sep and target.endswith(".py"):  # workers (Ray ones included) may run elsewhere: an absolute file
        return f"{Path(target).absolute()}:{fn}"
    return str(name)


def _stamp(path: str | Path) -> list[int] | None:
    try:
        st = Path(path).stat()
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def _fingerprint(eff: Any, metric: str, input: Path) -> str:
    """What a finished trial's result depends on besides its settings: the effective config, the
    metric (and its plugin file), the model file, a target profile file and constant data files.
    Any change rebuilds the trial on resume."""
    target, sep, _ = metric.rpartition(":")
    cfg = eff.cfg
    profile = Path(str(cfg.target_hardware))
    parts = {"config": eff.hash, "metric": metric, "input": _stamp(input),
             "plugin": _stamp(target) if sep and target.endswith(".py") else None,
             "profile": _stamp(profile) if profile.suffix.lower() in (".yaml", ".yml", ".json") else None,
             "consts": [_stamp(c.data_path) for c in cfg.const_processors or () if getattr(c, "data_path", None)]}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _previous(path: Path, settings: dict[str, Any], fingerprint: str) -> dict[str, Any] | None:
    try:
        row = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(row, dict) or row.pop("fingerprint", None) != fingerprint:
        return None
    if row.get("settings") != settings or row.get("status") != "ok":
        return None
    return dict(row, resumed=True)


def _preflight(config: Any, settings: list[dict[str, Any]], fixed: dict[str, Any], out: Path,
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


def sweep(input: str | Path, config: str | Path | dict[str, Any] | None, space: str | Path,
          output_dir: str | Path, *, metric: str | None = None, workers: int | None = None,
          ray: str | None = None, target_metric: float | None = None, quiet: bool = False) -> list[dict[str, Any]]:
    """Run the sweep; returns the trial table (the ``trials`` of ``sweep.json``). ``ray``: a Ray address
    ("" or "local" starts a local instance) to run the trials on instead of local processes."""
    from pulsar.ui import setup_logging
    from pulsar.utils.signals import terminate_as_interrupt

    setup_logging(quiet=quiet)
    if workers is not None and workers < 1:
        raise PulsarError(f"--workers must be at least 1, got {workers}")
    if ray is not None:
        if workers is not None:
            raise PulsarError("--workers sets local worker processes; with --ray, Ray schedules one trial per free "
                              "CPU of the cluster: drop --workers")
        from pulsar.search.ray_backend import require_ray

        require_ray()
    # absolute paths: every worker (a Ray node included) resolves them alike, and the work dir stays in OUT
    out, input = Path(output_dir).absolute(), Path(input).absolute()
    if isinstance(config, str | Path):
        config = Path(config).absolute()
    name = _metric_of(config, input, out, metric)
    settings = trials(load_space(space))
    fixed: dict[str, Any] = {"input": str(input), "work_dir": str(out / "work"), "evaluation.metric": name}
    check_trials(config, settings, {**fixed, "output_dir": str(out / "trials" / "0")}, space)
    check_dir_path(out, "--output_dir")
    prints = [_fingerprint(e, name, input) for e in _preflight(config, settings, fixed, out, metric is not None)]
    cfg = str(config) if isinstance(config, Path) else config
    jobs: list[dict[str, Any]] = [{"trial": k, "settings": s, "dir": str(out / "trials" / str(k)), "input": str(input),
                                   "config": cfg, "fixed": fixed, "fingerprint": prints[k]}
                                  for k, s in enumerate(settings)]
    rows: dict[int, dict[str, Any]] = {}
    todo = []
    for job in jobs:
        prev = _previous(Path(job["dir"]) / "trial.json", job["settings"], job["fingerprint"])
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
            results: Iterator[dict[str, Any]] = iter(_skipped(todo))
        elif todo and ray is not None:
            from pulsar.search.ray_backend import run_on_ray

            results = run_on_ray(todo, ray, stop)
        else:
            n = _workers(workers, len(todo))
            threads = max(1, (os.cpu_count() or 1) // n)
            log.info("sweep: %d local worker processes, %d thread(s) each", n, threads)
            results = _run_local([{**job, "threads": threads} for job in todo], n, stop)
        for row in results:
            rows[row["trial"]] = row
            log.info("trial %d/%d %s: %s %s, %s ms%s", row["trial"], len(jobs), row["status"], name,
                     row.get("metric"), row.get("latency_ms"), f" ({row['error']})" if row.get("error") else "")
    table = [rows[k] for k in sorted(rows)]
    best = _best(table, target_metric)
    write_report(out, table, name, best)
    return table


def _skipped(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [failed_row(job, "not run: a trial met --target-metric", status="skipped") for job in jobs]


def _run_local(jobs: list[dict[str, Any]], n: int, stop: Callable[[list[dict[str, Any]]], bool]
               ) -> Iterator[dict[str, Any]]:
    """Rows of ``jobs`` as they finish in ``n`` worker processes; none starts once ``stop(rows so far)``.

    A worker that dies (killed for memory, a plugin calling os._exit) breaks the pool: the trials in
    flight then are failed rows and a fresh pool takes the rest."""
    rows: list[dict[str, Any]] = []
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
                        rows.append(failed_row(job, DIED))
                    except Exception as exc:  # noqa: BLE001 - a trial that could not even report: still a row
                        rows.append(failed_row(job, f"{type(exc).__name__}: {exc}"))
                    yield rows[-1]
                if broken:  # every trial still in this pool died with it
                    for job in pending.values():
                        rows.append(failed_row(job, DIED))
                        yield rows[-1]
                    pending.clear()
                    break
        except BaseException:  # Ctrl-C / SIGTERM: stop the builds in flight now, not when they finish
            _terminate(pool)
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    yield from _skipped(queue)


def _terminate(pool: ProcessPoolExecutor) -> None:
    for proc in list((getattr(pool, "_processes", None) or {}).values()):
        proc.terminate()


def _met(rows: Any, target: float | None) -> bool:
    return target is not None and any(r["status"] == "ok" and r["metric"] >= target for r in rows)


def _best(rows: list[dict[str, Any]], target: float | None) -> int | None:
    """The fastest finished trial meeting ``target`` (None without a target or when none meets it)."""
    if target is None:
        return None
    ok = [r for r in rows if r["status"] == "ok" and r["metric"] >= target and r["latency_ms"] is not None]
    return min(ok, key=lambda r: (r["latency_ms"], -r["metric"]))["trial"] if ok else None
