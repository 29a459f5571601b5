"""Trials as tasks on a Ray cluster (``pulsar sweep --ray [ADDRESS]``; the optional extra ``[ray]``).

Each task builds in a temporary folder on its worker and returns the trial's files; the driver
writes them into ``OUT/trials/<k>/``, so the sweep's output is the same as a local run's wherever
the workers are. The model, configs, data and a plugin file must be at the same paths on the
workers (a shared filesystem, or a local Ray instance)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pulsar.errors import PulsarError
from pulsar.search.trial import failed_row
from pulsar.utils.atomic import atomic_write_bytes

LOCAL = ("", "local")  # start a local Ray instance


def _remote_trial(job: dict[str, Any]) -> tuple[dict[str, Any], dict[str, bytes]]:
    """On the worker: the trial in a temporary folder, then its files (relative path -> bytes)."""
    import tempfile

    from pulsar.search.trial import run_trial

    with tempfile.TemporaryDirectory(prefix="pulsar_trial_") as tmp:
        row = run_trial({**job, "dir": str(Path(tmp) / "trial")})
        root = Path(tmp) / "trial"
        files = {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    return row, files


def require_ray() -> None:
    """A clear error, before anything is written, when the optional extra is not installed."""
    try:
        import ray  # noqa: F401
    except ImportError:
        raise PulsarError('--ray needs Ray, an optional extra: pip install "pulsar-npu[ray]" (or run without '
                          "--ray: local worker processes)") from None


def run_on_ray(jobs: list[dict[str, Any]], address: str, stop: Callable[[list[dict[str, Any]]], bool]
               ) -> Iterator[dict[str, Any]]:
    """Rows of ``jobs`` as their tasks finish; no new task starts once ``stop(rows so far)``."""
    require_ray()
    import ray

    try:
        ray.init(address=None if address in LOCAL else address, ignore_reinit_error=True, include_dashboard=False,
                 log_to_driver=False, logging_level=logging.ERROR)
    except Exception as exc:  # noqa: BLE001 - Ray's connection errors have many types
        raise PulsarError(f"--ray {address or 'local'}: cannot start or reach Ray ({exc}); check the address "
                          "(ray://host:10001 or host:6379) or run without --ray") from None
    # one CPU and one thread (trial.py); no retries: a trial that kills its worker is a failed row, as locally
    task = ray.remote(num_cpus=1, max_retries=0)(_remote_trial)
    resources: dict[str, float] = ray.available_resources()  # type: ignore[no-untyped-call]
    slots = max(1, int(resources.get("CPU", 1)))
    queue = list(jobs)
    pending: dict[Any, dict[str, Any]] = {}
    rows: list[dict[str, Any]] = []
    while queue or pending:
        while queue and len(pending) < slots and not stop(rows):
            job = queue.pop(0)
            pending[task.remote({k: v for k, v in job.items() if k != "dir"} | {"dir": "", "threads": 1})] = job
        if not pending:
            break
        done, _ = ray.wait(list(pending), num_returns=1)
        for ref in done:
            job = pending.pop(ref)
            try:
                row, files = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - a worker that died (RayTaskError, WorkerCrashedError, ...)
                row, files = failed_row(job, f"its Ray task failed: {type(exc).__name__}: "
                                             f"{(str(exc).strip().splitlines() or [''])[0]}"), {}
            dest = Path(job["dir"])
            for rel, data in files.items():
                target = dest / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(target, data)
            rows.append(row)
            yield row
    for job in queue:
        yield failed_row(job, "not run: a trial met --target-metric", status="skipped")
