"""Run cases in worker processes, one test at a time each, with a time limit: a hang is killed and reported."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from bench.conformance.cases import Case


def _worker(conn: Connection, work: str, runner: str) -> None:
    import logging
    import os

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.disable(logging.CRITICAL)
    import onnxruntime

    onnxruntime.set_default_logger_severity(3)  # the node tests trip warnings (unused initializers) by design
    import importlib

    module, _, fn = runner.partition(":")
    run_case = getattr(importlib.import_module(module), fn)

    while True:
        job = conn.recv()
        if job is None:
            return
        index, case = job
        conn.send((index, run_case(case, Path(work) / f"{index:04d}_{case.name}")))


class _Slot:
    def __init__(self, ctx: Any, work: Path, runner: str) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, str(work), runner), daemon=True)
        self.proc.start()
        self.job: tuple[int, Case] | None = None
        self.started = 0.0


def run_all(cases: list[Case], work: Path, jobs: int, timeout: float,
            on_result: Callable[[dict[str, Any]], None] | None = None,
            runner: str = "bench.conformance.runner:run_case") -> Iterator[dict[str, Any]]:
    """Results of every case (in completion order); a case over ``timeout`` seconds is a ``hang``;
    a worker that dies is a ``crash`` of its case. ``runner``: ``module:function`` taking (case, folder)."""
    ctx = mp.get_context("spawn")
    todo = list(enumerate(cases))[::-1]
    slots = [_Slot(ctx, work, runner) for _ in range(max(1, min(jobs, len(cases))))]
    try:
        while todo or any(s.job for s in slots):
            for s in slots:
                if s.job is None and todo:
                    s.job, s.started = todo.pop(), time.monotonic()
                    s.conn.send(s.job)
            busy = [s for s in slots if s.job is not None]
            ready = wait([s.conn for s in busy] + [s.proc.sentinel for s in busy], timeout=1.0)
            for i, s in enumerate(slots):
                if s.job is None:
                    continue
                index, case = s.job
                res = None
                if s.conn in ready:
                    try:
                        _, res = s.conn.recv()
                    except EOFError:
                        res = None
                if res is None and (s.proc.sentinel in ready or not s.proc.is_alive()):
                    res = {"name": case.name, "ops": case.ops, "opset": case.opset, "status": "crash",
                           "reason": f"worker died (exit code {s.proc.exitcode})"}
                elif res is None and time.monotonic() - s.started > timeout:
                    res = {"name": case.name, "ops": case.ops, "opset": case.opset, "status": "hang",
                           "reason": f"over {timeout:.0f} s"}
                if res is None:
                    continue
                res["seconds"] = round(time.monotonic() - s.started, 2)
                s.job = None
                if res["status"] in ("crash", "hang") and "stage" not in res:
                    s.proc.kill()
                    s.proc.join()
                    slots[i] = _Slot(ctx, work, runner)
                if on_result is not None:
                    on_result(res)
                yield res
    finally:
        for s in slots:
            with contextlib.suppress(OSError, BrokenPipeError):
                s.conn.send(None)
            s.proc.join(timeout=5)
            if s.proc.is_alive():
                s.proc.kill()
