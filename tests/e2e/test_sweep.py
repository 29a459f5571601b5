"""``pulsar sweep`` on the tiny CNN: the trial table, a Pareto front that matches the table, the PNG and
HTML report, resuming without rebuilding (and rebuilding a trial whose record was edited),
--target_metric, workers that die, two sweeps into one folder, and bad search spaces as one error line.
tests/hostile/test_sweep_inputs.py holds the refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

import pulsar
from pulsar.errors import PulsarError
from tests.cli_fork import run_pulsar
from tests.tiny_model import make_numpy_calibration

# many real builds in subprocesses: outside the fast tier (pytest -m "not slow"); CI runs them
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base(tiny, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sweep_base")
    data = make_numpy_calibration(root / "eval", n=12, seed=11)
    calib = [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]), "calibration_format": "Numpy",
              "calibration_size": 8}]
    cfg = {"quant": {"input_configs": calib}, "evaluation": {"metric": "cosine", "input_configs": [
        {"tensor_name": "image", "calibration_dataset": str(data), "calibration_format": "Numpy",
         "calibration_size": -1}]}}
    path = root / "base.json"
    path.write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def space(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("space") / "space.yaml"
    path.write_text("quant.calibration_method: [MinMax, Percentile, MSE]\nnpu_mode: [NPU1, NPU2]\n")
    return path


@pytest.fixture(scope="module")
def swept(tiny, base, space, tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("sweep") / "out"
    return out, pulsar.sweep(tiny["model"], base, space, out, workers=2, quiet=True)


def test_every_trial_is_a_row_and_the_front_matches_the_table(swept) -> None:
    out, rows = swept
    report = json.loads((out / "sweep.json").read_text())
    assert report["trials"] == json.loads(json.dumps(rows))
    assert len(rows) == 6 and all(r["status"] == "ok" for r in rows), rows
    assert [r["settings"]["npu_mode"] for r in rows] == ["NPU1", "NPU2"] * 3
    for r in rows:
        assert 0.9 < r["metric"] <= 1.0 and r["latency_ms"] > 0 and r["size_bytes"] > 0 and r["build_s"] > 0
        assert (out / "trials" / str(r["trial"]) / "compiled.pulsar").is_file()
    # the front, recomputed by brute force from the table
    for r in rows:
        dominated = any(q["metric"] >= r["metric"] and q["latency_ms"] <= r["latency_ms"]
                        and (q["metric"], -q["latency_ms"]) != (r["metric"], -r["latency_ms"]) for q in rows)
        assert r["pareto"] == (not dominated), r
    assert any(r["pareto"] for r in rows)
    # two cores never run slower than one: NPU2 trials are at least as fast as their NPU1 twins
    assert all(rows[i + 1]["latency_ms"] <= rows[i]["latency_ms"] for i in range(0, 6, 2))


def test_the_report_is_a_png_and_a_self_contained_page(swept) -> None:
    out, rows = swept
    with Image.open(out / "sweep.png") as im:
        im.verify()
        assert im.format == "PNG" and im.size[0] > 300
    page = (out / "sweep.html").read_text()
    assert "data:image/png;base64," in page and page.count("<tr") == len(rows) + 1
    assert "http" not in page.replace("http-equiv", "")  # nothing fetched from elsewhere


def test_a_resumed_sweep_rebuilds_nothing(tiny, base, space, swept) -> None:
    out, rows = swept
    stamps = {p: p.stat().st_mtime_ns for p in (out / "trials").glob("*/compiled.pulsar")}
    again = pulsar.sweep(tiny["model"], base, space, out, workers=2, quiet=True)
    assert all(r.get("resumed") for r in again)
    assert [r["metric"] for r in again] == [r["metric"] for r in rows]
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps


def test_target_metric_stops_launching_and_names_the_fastest(tiny, base, space, tmp_path) -> None:
    rows = pulsar.sweep(tiny["model"], base, space, tmp_path / "out", workers=1, target_metric=0.0, quiet=True)
    assert rows[0]["status"] == "ok" and all(r["status"] == "skipped" for r in rows[1:])
    assert json.loads((tmp_path / "out" / "sweep.json").read_text())["best"] == 0


@pytest.mark.parametrize(("text", "needle"), [
    ("quant.calibration_methd: [KL]\n", 'is not a config field (did you mean "quant.calibration_method"?)'),
    ("quant.calibration_method: KL\n", "must be a non-empty list of values"),
    ("quant.calibration_method: [3]\n", "trial 0 (quant.calibration_method=3)"),
    ("output_dir: [a]\n", "is set by the sweep itself"),
    ("1: [a]\n", "key 1 is not a string"),
    ("npu_mode: [NPU1]\nnpu_mode: [NPU2]\n", "npu_mode: duplicate key"),
    ("lsq:\n  - {quant.enable_lsq: true, quant.finetune_epoch: 3}\n",
     "group 'lsq', item 0: 'quant.finetune_epoch' is not a config field (did you mean \"quant.finetune_epochs\"?)"),
    ("lsq: [{quant.enable_lsq: true}, 3]\n", "group 'lsq': item 1 must be a mapping"),
    ("quant.enable_lsq: [true]\nlsq: [{quant.enable_lsq: false}]\n", "is set by both 'quant.enable_lsq' and 'lsq'"),
    ("lsq: [{--quant.enable_lsq: true, quant.enable_lsq: false}]\n", "item 0: a field is given twice"),
    ("quant.enable_lsq: [true]\nquant.enable_adaround: [false, true]\n",
     "trial 1 (quant.enable_lsq=True, quant.enable_adaround=True)"),
])
def test_bad_search_spaces_are_one_error_line(tiny, base, tmp_path, text: str, needle: str) -> None:
    space = tmp_path / "space.yaml"
    space.write_text(text)
    proc = run_pulsar(["sweep", "--input", str(tiny["model"]), "--config",
                      str(base), "--space", str(space), "--output_dir", str(tmp_path / "out")],
                      timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], proc.stderr
    assert not (tmp_path / "out" / "trials").exists()


def test_a_group_sets_its_fields_together_in_one_trial(tiny, base, tmp_path) -> None:
    """Fine-tuning steps only act with a fine-tuning switch (a build rejects them alone), so they vary
    with it as a group; each trial's build really got the group's fields."""
    space = tmp_path / "space.yaml"
    space.write_text("npu_mode: [NPU1, NPU2]\n"
                     "finetune:\n  - {quant.enable_lsq: false}\n"
                     "  - {quant.enable_lsq: true, quant.finetune_epochs: 3, quant.finetune_batch_size: 2}\n")
    rows = pulsar.sweep(tiny["model"], base, space, tmp_path / "out", workers=2, quiet=True)
    assert [r["settings"] for r in rows] == [
        {"npu_mode": m, "quant.enable_lsq": False} if k % 2 == 0 else
        {"npu_mode": m, "quant.enable_lsq": True, "quant.finetune_epochs": 3, "quant.finetune_batch_size": 2}
        for k, m in enumerate(["NPU1", "NPU1", "NPU2", "NPU2"])]
    assert all(r["status"] == "ok" for r in rows), rows
    for r in rows:
        log = (tmp_path / "out" / "trials" / str(r["trial"]) / "build.log").read_text()
        assert ("LSQ" in log) == r["settings"]["quant.enable_lsq"], log
    html = (tmp_path / "out" / "sweep.html").read_text().replace("<wbr>", "")
    assert "quant.finetune_epochs" in html and "null" not in html  # a field a trial does not set is blank


@pytest.mark.parametrize(("args", "needle"), [
    ({"--metric": "toop1"}, "--metric: 'toop1' is not a built-in metric"),
    ({"--metric": "top1"}, "evaluation.labels: the metric top1 needs labels"),
    ({"--input": "missing.onnx"}, "missing.onnx"),
    ({"--workers": "2", "--ray": None}, "--workers sets local worker processes"),
    ({"--output_dir": "a_file/out"}, "a_file"),
])
def test_mistakes_every_trial_would_hit_are_one_error_line_before_any_trial(tiny, base, space, tmp_path, args,
                                                                            needle) -> None:
    opts = {"--input": str(tiny["model"]), "--config": str(base), "--space": str(space), "--output_dir": "out",
            **args}
    argv = [a for k, v in opts.items() for a in ([k] if v is None else [k, v])]
    (tmp_path / "a_file").write_text("not a folder")
    proc = run_pulsar(["sweep", *argv], timeout=300, cwd=tmp_path, env={**os.environ, "COLUMNS": "200",
                      "PYTHONPATH": str(Path.cwd())})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], proc.stderr
    assert not (tmp_path / "out").exists() and (tmp_path / "a_file").read_text() == "not a folder"


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return run_pulsar(["sweep", *args], timeout=300, cwd=cwd, env={**os.environ, "COLUMNS": "200"})


def _errors(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def test_a_dying_worker_is_a_failed_row_and_leaves_nothing_behind(tiny, tiny_config, tmp_path) -> None:
    """The process building a trial is killed (by its metric, which SIGKILLs its parent, as the OOM killer
    would): failed rows with the reason, a fresh pool for the next trial, the report written, each dead
    trial's staging folder and lock removed and its trial.json written (sweep.json and the records agree)."""
    plugin = tmp_path / "deadly.py"
    plugin.write_text("import os, signal\ndef kills_worker(session):\n    os.kill(os.getppid(), signal.SIGKILL)\n"
                      "    return 1.0\n")
    space = tmp_path / "space.yaml"
    space.write_text("npu_mode: [NPU1, NPU2]\n")
    base = tmp_path / "base.json"  # no evaluation data: a plugin reads its own
    base.write_text(json.dumps(tiny_config))
    out = tmp_path / "out"
    rows = pulsar.sweep(tiny["model"], base, space, out, metric=f"{plugin}:kills_worker", workers=1, quiet=True)
    assert [r["status"] for r in rows] == ["failed", "failed"]
    assert all("worker process died" in r["error"] for r in rows), rows
    assert json.loads((out / "sweep.json").read_text())["trials"] == [{**r, "pareto": False} for r in rows]
    for r in rows:
        folder = out / "trials" / str(r["trial"])
        assert not list(folder.glob(".pulsar*")), list(folder.iterdir())  # no staging folder, no lock
        record = json.loads((folder / "trial.json").read_text())
        assert record["status"] == "failed" and "worker process died" in record["error"]


def test_a_metric_that_kills_or_exits_its_process_is_a_failed_row(tiny, tiny_config, tmp_path) -> None:
    """A plugin runs in a process of its own: killing it or calling sys.exit fails the trial with the
    plugin's name and what it did; the worker lives on, and the CLI ends with its one error line."""
    plugin = tmp_path / "deadly.py"
    plugin.write_text("import os, signal, sys\n"
                      "def killed(session):\n    os.kill(os.getpid(), signal.SIGKILL)\n"
                      "def exits(session):\n    sys.exit(3)\n")
    space = tmp_path / "space.yaml"
    space.write_text("npu_mode: [NPU1, NPU2]\n")
    base = tmp_path / "base.json"
    base.write_text(json.dumps(tiny_config))
    rows = pulsar.sweep(tiny["model"], base, space, tmp_path / "a", metric=f"{plugin}:killed", workers=1, quiet=True)
    assert [r["status"] for r in rows] == ["failed", "failed"]
    assert all("deadly.py:killed was killed by SIGKILL" in r["error"] and "the float model" in r["error"]
               for r in rows), rows
    assert not list((tmp_path / "a" / "trials").glob("*/.pulsar*"))
    proc = _cli("--input", str(tiny["model"]), "--config", str(base), "--space", str(space), "--output_dir",
                str(tmp_path / "b"), "--metric", f"{plugin}:exits")
    assert proc.returncode == 2, proc.stderr
    errors = _errors(proc)
    assert len(errors) == 1 and "every trial failed" in errors[0] and "exits() raised SystemExit" in errors[0], \
        proc.stderr
    assert (tmp_path / "b" / "sweep.json").is_file()


def test_a_second_sweep_into_the_same_folder_fails_at_once_and_the_first_stays_whole(tiny, tiny_config,
                                                                                     tmp_path) -> None:
    """The sweep holds its folder's lock, as a build does: a second sweep there is one error line naming
    the first (its pid), and the first finishes with sweep.json agreeing with every trial.json."""
    plugin = tmp_path / "slow.py"
    plugin.write_text("import time\ndef slow(session):\n    time.sleep(2)\n    return 0.5\n")
    space = tmp_path / "space.yaml"
    space.write_text("npu_mode: [NPU1, NPU2]\n")
    base = tmp_path / "base.json"
    base.write_text(json.dumps(tiny_config))
    args = ["--input", str(tiny["model"]), "--config", str(base), "--space", str(space), "--output_dir",
            str(tmp_path / "out"), "--metric", f"{plugin}:slow", "--workers", "1"]
    first = subprocess.Popen([sys.executable, "-m", "pulsar", "sweep", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "200"})
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "out" / ".pulsar.lock").exists() and first.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        second = _cli(*args)
        assert first.poll() is None, "the first sweep ended before the second one was refused: make it slower"
        out, err = first.communicate(timeout=300)
    finally:
        first.kill()
    assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr
    errors = _errors(second)
    assert len(errors) == 1 and "is in use by another pulsar build" in errors[0], second.stderr
    assert f"pid {first.pid}" in errors[0], errors[0]
    assert first.returncode == 0, err
    report = json.loads((tmp_path / "out" / "sweep.json").read_text())["trials"]
    assert [r["status"] for r in report] == ["ok", "ok"]
    for r in report:
        record = json.loads((tmp_path / "out" / "trials" / str(r["trial"]) / "trial.json").read_text())
        record.pop("fingerprint")
        assert {k: v for k, v in r.items() if k != "pareto"} == record
    assert not (tmp_path / "out" / ".pulsar.lock").exists()


def test_a_resumed_sweep_reruns_a_trial_whose_record_was_edited(tiny, base, tmp_path) -> None:
    """trial.json is the sweep's own cache: one whose figures are not what a trial writes (a metric
    "0.9", a latency "fast") is not trusted; its trial is built again, with a warning naming the file."""
    space = tmp_path / "space.yaml"
    space.write_text("npu_mode: [NPU1, NPU2]\n")
    args = ["--input", str(tiny["model"]), "--config", str(base), "--space", str(space), "--output_dir", "out"]
    assert _cli(*args, cwd=tmp_path).returncode == 0
    record = tmp_path / "out" / "trials" / "0" / "trial.json"
    row = json.loads(record.read_text())
    record.write_text(json.dumps({**row, "metric": "0.9", "latency_ms": "fast"}))
    stamps = {k: (tmp_path / "out" / "trials" / k / "compiled.pulsar").stat().st_mtime_ns for k in "01"}
    proc = _cli(*args, cwd=tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "trials/0/trial.json: metric is '0.9'" in proc.stderr and "trial 0 runs again" in proc.stderr
    trials = json.loads((tmp_path / "out" / "sweep.json").read_text())["trials"]
    assert not trials[0].get("resumed") and trials[1]["resumed"]
    assert trials[0]["metric"] == row["metric"] and trials[0]["latency_ms"] == row["latency_ms"]
    assert (tmp_path / "out" / "trials" / "0" / "compiled.pulsar").stat().st_mtime_ns != stamps["0"]
    assert (tmp_path / "out" / "trials" / "1" / "compiled.pulsar").stat().st_mtime_ns == stamps["1"]


def test_help_and_the_target_metric_flag(tiny, base, space, tmp_path) -> None:
    """--target_metric is spelled like every other flag; the old --target-metric still works (hidden); the
    help shows the [ray] extra literally."""
    proc = run_pulsar(["sweep", "--help"], timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0 and "needs the [ray] extra" in proc.stdout, proc.stdout
    assert "--target_metric" in proc.stdout and "--target-metric" not in proc.stdout
    proc = _cli("--input", str(tiny["model"]), "--config", str(base), "--space", str(space), "--output_dir",
                str(tmp_path / "out"), "--workers", "1", "--target-metric", "0")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert report["best"] == 0 and [r["status"] for r in report["trials"]] == ["ok"] + ["skipped"] * 5
    assert "not run: a trial met --target_metric" in report["trials"][1]["error"]


def test_resume_rebuilds_a_trial_whose_metric_or_model_changed(tiny, base, tmp_path) -> None:
    space = tmp_path / "space.yaml"
    space.write_text("npu_mode: [NPU1]\n")
    out = tmp_path / "out"
    first = pulsar.sweep(tiny["model"], base, space, out, quiet=True)
    again = pulsar.sweep(tiny["model"], base, space, out, metric="top1_agreement", quiet=True)
    assert not again[0].get("resumed") and again[0]["metric"] == 1.0 != first[0]["metric"]
    assert json.loads((out / "trials" / "0" / "evaluation.json").read_text())["metric"] == "top1_agreement"
    assert pulsar.sweep(tiny["model"], base, space, out, metric="top1_agreement", quiet=True)[0]["resumed"]
    model = tmp_path / "model.onnx"  # the same settings on another model file: rebuilt
    model.write_bytes(Path(tiny["model"]).read_bytes())
    assert not pulsar.sweep(model, base, space, out, metric="top1_agreement", quiet=True)[0].get("resumed")


def test_a_resumed_sweep_that_met_its_target_still_lists_every_trial(tiny, base, space, tmp_path) -> None:
    out = tmp_path / "out"
    first = pulsar.sweep(tiny["model"], base, space, out, workers=1, target_metric=0.0, quiet=True)
    again = pulsar.sweep(tiny["model"], base, space, out, workers=1, target_metric=0.0, quiet=True)
    assert len(again) == len(first) == 6 and [r["status"] for r in again] == ["ok"] + ["skipped"] * 5
    assert again[0]["resumed"]


def test_the_front_holds_only_finished_trials_with_a_finite_metric() -> None:
    from pulsar.search.report import pareto

    rows = [{"trial": k, "status": s, "metric": m, "latency_ms": t} for k, (s, m, t) in enumerate([
        ("ok", float("nan"), 5.0), ("ok", 0.9, 1.0), ("ok", 0.8, 2.0), ("ok", 0.95, None), ("failed", None, None),
        ("ok", 0.97, 3.0)])]
    pareto(rows)
    assert [r["pareto"] for r in rows] == [False, True, False, False, False, True]


def test_a_sweep_needs_a_metric(tiny, tiny_config, space, tmp_path) -> None:
    with pytest.raises(PulsarError, match="a sweep needs a metric"):
        pulsar.sweep(tiny["model"], tiny_config, space, tmp_path / "a", quiet=True)
    assert not (tmp_path / "a").exists()


def test_the_same_sweep_on_a_local_ray_instance_gives_the_same_table(tiny, base, space, swept, tmp_path) -> None:
    ray = pytest.importorskip("ray")
    try:
        rows = pulsar.sweep(tiny["model"], base, space, tmp_path / "out", ray="local", quiet=True)
    finally:
        ray.shutdown()
    _, local = swept

    def key(r: dict) -> tuple:
        return r["settings"], r["status"], r["metric"], r["latency_ms"], r["size_bytes"], r["pareto"]

    assert [key(r) for r in rows] == [key(r) for r in local]
    for r in rows:  # each trial's artifacts came back into the sweep's own folder
        assert (tmp_path / "out" / "trials" / str(r["trial"]) / "compiled.pulsar").is_file()
        assert (tmp_path / "out" / "trials" / str(r["trial"]) / "trial.json").is_file()


def test_ray_without_the_extra_is_one_error_line(tiny, base, space, tmp_path) -> None:
    """Ray made unimportable in a fresh interpreter: the error names the extra, nothing is written."""
    code = ("import sys; sys.modules['ray'] = None; sys.argv = ['pulsar', 'sweep', '--input', sys.argv[1], "
            "'--config', sys.argv[2], '--space', sys.argv[3], '--output_dir', sys.argv[4], '--ray']; "
            "from pulsar.cli import main; main()")
    proc = subprocess.run([sys.executable, "-c", code, str(tiny["model"]), str(base), str(space),
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and 'pip install "pulsar-npu[ray]"' in errors[0], proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.skipif(not (Path(__file__).resolve().parents[2] / "examples" / "assets" / "mobilenetv2.onnx").is_file(),
                    reason="the example assets are not made (python examples/make_assets.py)")
def test_the_readme_sweep_of_the_example_model(tmp_path) -> None:
    """The README's command, as written, on the example MobileNetV2 with configs/mobilenetv2.json (uint8
    NHWC input processors): every trial scores, the float model agrees with itself on every crop."""
    root = Path(__file__).resolve().parents[2]
    proc = run_pulsar(["sweep", "--input", "examples/assets/mobilenetv2.onnx",
                      "--config", "configs/mobilenetv2.json", "--space", "configs/mobilenetv2_sweep.yaml",
                      "--metric", "examples/sweep_metric.py:top1_agreement", "--output_dir",
                      str(tmp_path / "sweep_mbv2")], timeout=1800, cwd=root,
                      env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((tmp_path / "sweep_mbv2" / "sweep.json").read_text())["trials"]
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows), rows
    assert all(r["metric_float"] == 1.0 and 0.5 < r["metric"] <= 1.0 for r in rows), rows
