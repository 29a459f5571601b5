"""One trial: a build with the trial's settings in ``OUT/trials/<k>/``, scored and measured.

Runs in a worker process. A trial that fails is a row with ``status`` "failed" and the error line,
never an exception: the sweep goes on. ``trial.json`` in the trial's folder (the row plus the
trial's fingerprint) is what a resumed sweep reads to skip it."""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path
from typing import Any

from pulsar.utils.atomic import atomic_write_text


def failed_row(job: dict[str, Any], error: str, status: str = "failed") -> dict[str, Any]:
    """The row of a trial that has no result: ``error`` says why."""
    return {"trial": job["trial"], "settings": job["settings"], "status": status, "metric": None,
            "latency_ms": None, "size_bytes": None, "build_s": None, "error": error}


def _set_threads(n: int) -> None:
    """The trial's share of the cores for torch (fine-tuning, the simulator). Besides avoiding
    oversubscription, it makes fine-tuning repeatable: its float sums depend on the thread count, so a
    trial scores the same wherever it runs with the same count (a Ray task runs with one)."""
    import torch

    torch.set_num_threads(n)


def run_trial(job: dict[str, Any]) -> dict[str, Any]:
    import pulsar
    from pulsar.core.container import load_compiled
    from pulsar.errors import PulsarError

    out = Path(job["dir"])
    row = failed_row(job, "")
    t0 = time.perf_counter()
    try:
        _set_threads(int(job.get("threads") or 1))
        built = pulsar.build(job["input"], out, job["config"], overrides={**job["settings"], **job["fixed"]},
                             quiet=True)
        ev = json.loads((out / "evaluation.json").read_text())
        est = load_compiled(built.compiled_model).metadata.get("estimate") or {}
        row.update(status="ok", metric=ev["npu"], metric_float=ev["float"], metric_qdq=ev["qdq"],
                   latency_ms=est.get("time_ms") if isinstance(est, dict) else None,
                   size_bytes=built.compiled_model.stat().st_size)
        del row["error"]
    except PulsarError as exc:
        row["error"] = str(exc)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - a pulsar bug or sys.exit() still must not end the sweep
        row["error"] = f"{type(exc).__name__}: {exc} ({traceback.format_exc(limit=1).splitlines()[-1]})"
    row["build_s"] = round(time.perf_counter() - t0, 2)
    return write_record(job, row)


def write_record(job: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """``trial.json`` in the trial's folder: the row plus the fingerprint a resumed sweep matches."""
    out = Path(job["dir"])
    try:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "trial.json", json.dumps({**row, "fingerprint": job.get("fingerprint")}, indent=1)
                          + "\n")
    except OSError as exc:  # the row still reaches the report; only resuming this trial is lost
        row.setdefault("error", f"trial.json not written: {exc}")
    return row
