"""Hostile inputs for ``pulsar sweep``: spaces too large to run, Ray addresses where nothing listens,
non-finite targets, plugins that end the process, names and links that would carry writes elsewhere,
and an output directory another sweep holds.

Every case runs the real command in a directory of its own and must fail cleanly and at once: exit 2,
one ``error:`` line naming the flag / file / field, no traceback, nothing created or changed in the
case directory (no trial run, no report, no lock left).
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.hostile.harness import Case, assert_clean_failure, run_case

SPACE = "npu_mode: [NPU1, NPU2]\n"


@dataclass(frozen=True)
class Env:
    model: Path  # the tiny CNN (outside every case directory)
    calib: Path  # its 8 Numpy samples (calibration and evaluation data)


Setup = Callable[[Path, Env], list[str]]
_HELD: list[int] = []  # lock file descriptors held for the module's cases (closed at teardown)


def _base(env: Env, **extra: Any) -> dict[str, Any]:
    entry = {"tensor_name": "image", "calibration_dataset": str(env.calib), "calibration_format": "Numpy",
             "calibration_size": 8}
    return {"quant": {"input_configs": [entry]}, "evaluation": {"metric": "cosine", "input_configs": [entry]},
            **extra}


def sweep(*flags: str, space: str = SPACE, base: Callable[[Env], dict[str, Any]] = _base,
          prepare: Callable[[Path], None] | None = None) -> Setup:
    """``pulsar sweep`` of the tiny CNN into ``out`` with ``space`` and extra ``flags``; ``prepare(case_dir)``
    makes what the case needs (it belongs to the "before" state)."""

    def setup(d: Path, env: Env) -> list[str]:
        (d / "base.json").write_text(json.dumps(base(env)))
        (d / "space.yaml").write_text(space)
        if prepare is not None:
            prepare(d)
        return ["sweep", "--input", str(env.model), "--config", "base.json", "--space", "space.yaml",
                "--output_dir", "out", *flags]

    return setup


def _no_evaluation(env: Env) -> dict[str, Any]:
    """The base config of a plugin metric (a plugin reads its own data)."""
    return {"quant": _base(env)["quant"]}


def _million(_env: Env | None = None) -> str:
    fields = ["npu_mode", "quant.calibration_method", "quant.calibration_percentile", "compiler.check",
              "quant.finetune_epochs", "output_name"]
    return "".join(f"{f}: [{', '.join(str(i) for i in range(10))}]\n" for f in fields)


def _plugin_exits(d: Path) -> None:
    (d / "plug.py").write_text("import os\nos._exit(0)\n")


def _linked(name: str) -> Callable[[Path], None]:
    """``out/<name>`` a link to a folder outside the output directory."""

    def prepare(d: Path) -> None:
        (d / "elsewhere").mkdir()
        (d / "out" / name).parent.mkdir(parents=True)
        (d / "out" / name).symlink_to(d / "elsewhere")

    return prepare


def _linked_file(d: Path) -> None:
    """A finished-looking trial folder whose trial.json links to a file outside."""
    (d / "outside.json").write_text("{}")
    (d / "out" / "trials" / "1").mkdir(parents=True)
    (d / "out" / "trials" / "1" / "trial.json").symlink_to(d / "outside.json")


def _held(d: Path) -> None:
    """The output directory locked as a running sweep holds it (this test process is the holder)."""
    (d / "out").mkdir()
    fd = os.open(d / "out" / ".pulsar.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": "here", "started": "earlier",
                             "command": "pulsar sweep (the first one)"}).encode())
    _HELD.append(fd)


CASES: list[Case] = [
    Case("space_of_a_million_trials", sweep(space=_million()),
         ("search space space.yaml: 1,000,000 trials (10 npu_mode x 10 quant.calibration_method", "limit of 1,000")),
    Case("ray_nothing_listens", sweep("--ray", "127.0.0.1:1"),
         ("--ray 127.0.0.1:1: nothing answers at 127.0.0.1:1", "ray start --head")),
    Case("ray_not_an_address", sweep("--ray", "nowhere"), "--ray: 'nowhere' is not a Ray address"),
    Case("target_metric_nan", sweep("--target_metric", "nan"), "--target_metric: nan is not a finite number"),
    Case("target_metric_inf_old_spelling", sweep("--target-metric", "inf"),
         "--target_metric: inf is not a finite number"),
    Case("target_metric_both_spellings", sweep("--target_metric", "0.5", "--target-metric", "0.6"),
         "--target-metric is the old spelling of --target_metric"),
    Case("workers_zero", sweep("--workers", "0"), "--workers must be at least 1"),
    Case("plugin_os_exit_at_import", sweep("--metric", "plug.py:m", base=_no_evaluation, prepare=_plugin_exits),
         ("plug.py:m ended its process (exit code 0", "while it was imported")),
    Case("space_output_name_trial_json", sweep(space=SPACE + "output_name: [model.pulsar, trial.json]\n"),
         ("trial 1 (npu_mode='NPU1', output_name='trial.json')", "trial.json")),
    Case("base_output_name_trial_json", sweep(base=lambda e: _base(e, output_name="trial.json")),
         ("output_name", "trial.json")),
    Case("trial_folder_links_outside", sweep(prepare=_linked("trials/0")),
         ("--output_dir:", "trials/0 is a symbolic link (to", "follows no link")),
    Case("work_folder_links_outside", sweep(prepare=_linked("work")), ("--output_dir:", "work is a symbolic link")),
    Case("trial_record_links_outside", sweep(prepare=_linked_file),
         ("--output_dir:", "trials/1/trial.json is a symbolic link")),
    Case("output_dir_held_by_another_sweep", sweep(prepare=_held),
         ("--output_dir:", "is in use by another pulsar build", "pulsar sweep (the first one)")),
]




@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, tiny: dict[str, Path]) -> Any:
    root = tmp_path_factory.mktemp("hostile_sweep")
    env = Env(tiny["model"], tiny["calib"])
    try:
        with ThreadPoolExecutor(2) as pool:
            done = list(pool.map(lambda c: run_case(root, env, c), CASES))
        yield {case.id: (proc, before, d) for case, proc, before, d in done}
    finally:
        for fd in _HELD:
            os.close(fd)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_sweep_fails_cleanly(results: dict[str, tuple], case: Case) -> None:
    proc, before, d = results[case.id]
    assert_clean_failure(proc, case.needle, before, d)
    assert not (d / "out" / "trials").is_dir() or case.id.startswith(("trial_", "work_")), proc.stderr


def test_the_limit_is_counted_not_made() -> None:
    """A space of 10^60 trials is refused as fast as one of 10^6: the count is a product, no trial is made."""
    import time

    from pulsar.errors import PulsarError
    from pulsar.search.space import trials

    space = {f"f{i}": [{f"f{i}": v} for v in range(10)] for i in range(60)}
    t0 = time.perf_counter()
    with pytest.raises(PulsarError, match=r"space.yaml: 1(,000){20} trials .* more than the limit of 1,000"):
        trials(space, "space.yaml")
    assert time.perf_counter() - t0 < 1
