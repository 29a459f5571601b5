"""``pulsar sweep`` on a real model (slow): the PP-OCRv4 recognizer over calibration method x LSQ
fine-tuning off / on (a group with a short step count), scored by an exact-match plugin written here.
The Pareto flags must match a brute-force recomputation from the table, the PNG must open, and a
second run must rebuild nothing. bench/bench_sweep.py runs the 12-trial version, renders the HTML in
headless Chromium and repeats it on Ray."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

import pulsar
from examples.assets import make_example_assets, ocr_preprocess, render_text_lines

pytestmark = pytest.mark.slow

PLUGIN = '''import numpy as np
from examples import assets

_DATA = np.load(__file__.replace(".py", ".npz"), allow_pickle=False)
_CHARSET = assets.ppocr_charset(assets.ppocr_rec_model())


def exact_match(session):
    name = session.inputs[0].name
    reads = [assets.normalize_text(assets.ctc_decode(next(iter(session.run({name: x}).values())), _CHARSET))
             for x in _DATA["x"]]
    return float(np.mean([r == t for r, t in zip(reads, _DATA["text"].tolist())]))
'''


def _front(rows: list[dict]) -> set[int]:
    ok = [r for r in rows if r["status"] == "ok"]
    return {r["trial"] for r in ok if not any(
        (q["metric"], q["latency_ms"]) != (r["metric"], r["latency_ms"])
        and q["metric"] >= r["metric"] and q["latency_ms"] <= r["latency_ms"] for q in ok)}


def test_a_recognizer_sweep_with_an_exact_match_plugin(tmp_path) -> None:
    paths = make_example_assets(tmp_path / "assets", n_calib=8)
    lines = render_text_lines(8, seed=99, part="eval")
    np.savez(tmp_path / "ocr_metric.npz", x=np.stack([ocr_preprocess(img) for img, _ in lines]),
             text=np.array([t for _, t in lines]))
    (tmp_path / "ocr_metric.py").write_text(PLUGIN)
    base = {"input_shapes": "x:1x3x48x320", "quant": {"input_configs": [
        {"tensor_name": "x", "calibration_dataset": str(paths["ocr_calib"]), "calibration_format": "Numpy",
         "calibration_size": -1}]}}
    (tmp_path / "base.json").write_text(json.dumps(base))
    (tmp_path / "space.yaml").write_text(
        "quant.calibration_method: [MinMax, Percentile]\n"
        "lsq:\n  - {quant.enable_lsq: false}\n"
        "  - {quant.enable_lsq: true, quant.finetune_epochs: 3, quant.finetune_batch_size: 4}\n")
    out = tmp_path / "sweep"
    args = (paths["ocr_rec"], tmp_path / "base.json", tmp_path / "space.yaml", out)
    rows = pulsar.sweep(*args, metric=f"{tmp_path / 'ocr_metric.py'}:exact_match", workers=2, quiet=True)
    assert [r["status"] for r in rows] == ["ok"] * 4, [r.get("error") for r in rows]
    assert [r["settings"].get("quant.enable_lsq") for r in rows] == [False, True, False, True]
    report = json.loads((out / "sweep.json").read_text())
    assert report["trials"] == rows
    assert {r["trial"] for r in rows if r["pareto"]} == _front(rows)
    assert len({r["metric_float"] for r in rows}) == 1 and rows[0]["metric_float"] >= 0.75  # the same float model
    assert all(0 <= r["metric"] <= 1 and r["latency_ms"] > 0 and r["size_bytes"] > 0 for r in rows)
    for r in rows:  # LSQ really ran in the trials of its group, and only there
        log = (out / "trials" / str(r["trial"]) / "build.log").read_text()
        assert ("LSQ" in log) == r["settings"]["quant.enable_lsq"]
    with Image.open(out / "sweep.png") as im:
        im.verify()
        assert im.format == "PNG"
    mtimes = {p: p.stat().st_mtime_ns for p in out.glob("trials/*/compiled.pulsar")}
    again = pulsar.sweep(*args, metric=f"{tmp_path / 'ocr_metric.py'}:exact_match", workers=2, quiet=True)
    assert all(r["resumed"] for r in again) and [r["metric"] for r in again] == [r["metric"] for r in rows]
    assert len(mtimes) == 4 and mtimes == {p: p.stat().st_mtime_ns for p in mtimes}
