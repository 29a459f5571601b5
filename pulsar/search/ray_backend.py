"""Trials as tasks on a Ray cluster (``pulsar sweep --ray [ADDRESS]``; the optional extra ``[ray]``).

Each task builds in a temporary folder on its worker and returns the trial's files; the driver
writes them into ``OUT/trials/<k>/``, so the sweep's output is the same as a local run's wherever
the workers are. The model, configs, data and a plugin file must be at the same paths on the
workers (a shared filesystem, or a local Ray instance)."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pulsar.errors import PulsarError
from pulsar.search.trial import failed_row
from pulsar.utils.atomic import atomic_write_bytes

LOCAL = ("", "local")  # start a local Ray instance
PROBE_TIMEOUT_S = 5.0  # a Ray head answers a TCP connection at once; nothing there is refused or silent
CONNECT_TIMEOUT_S = 60.0


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


def _host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PulsarError(f"--ray: {address!r} is not a Ray address; give host:port (the head's GCS port, 6379 by "
                          "default), ray://host:10001 (Ray Client), or a bare --ray for a local instance")
    return host.strip("[]"), int(port)


def check_address(address: str) -> None:
    """The address parses and something answers there, before anything is written: ray.init waits many
    minutes for an address where nothing listens. A connection with a timeout says so at once."""
    if address in LOCAL or address == "auto":
        return
    host, port = _host_port(address)
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S):
            pass
    except OSError as exc:
        why = exc.strerror or str(exc) or type(exc).__name__
        raise PulsarError(f"--ray {address}: nothing answers at {host}:{port} ({why}); start the cluster there "
                          "(ray start --head) or check the address, or run without --ray") from None


def _connect(ray: Any, address: str) -> None:
    """``ray.init``: a local instance in this thread (its processes die with the thread that starts them);
    a cluster's address in a helper thread given CONNECT_TIMEOUT_S, since Ray retries an address that
    answers but is not a Ray head's for many minutes."""
    local = address in LOCAL
    box: dict[str, Exception] = {}

    def init() -> None:
        try:
            ray.init(address=None if local else address, ignore_reinit_error=True, include_dashboard=False,
                     log_to_driver=False, logging_level=logging.ERROR)
        except Exception as exc:  # noqa: BLE001 - Ray's connection errors have many types
            box["error"] = exc

    if local:
        init()
    else:
        thread = threading.Thread(target=init, name="pulsar-ray-connect", daemon=True)
        thread.start()
        thread.join(CONNECT_TIMEOUT_S)
        if thread.is_alive():
            raise PulsarError(f"--ray {address}: no Ray head answered within {CONNECT_TIMEOUT_S:.0f} s (something "
                              "listens there, but not Ray, or another Ray version); check the address (host:6379 or "
                              "ray://host:10001) or run without --ray")
    if "error" in box:
        exc = box["error"]
        raise PulsarError(f"--ray {address or 'local'}: cannot start or reach Ray ({type(exc).__name__}: "
                          f"{(str(exc).strip().splitlines() or [''])[0]}); check the address (ray://host:10001 or "
                          "host:6379) or run without --ray") from None


def run_on_ray(jobs: list[dict[str, Any]], address: str, stop: Callable[[list[dict[str, Any]]], bool]
               ) -> Iterator[dict[str, Any]]:
    """Rows of ``jobs`` as their tasks finish; no new task starts once ``stop(rows so far)``."""
    require_ray()
    import ray

    _connect(ray, address)
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
        yield failed_row(job, "not run: a trial met --target_metric", status="skipped")
