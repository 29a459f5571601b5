"""bench.bench_quant's specs without running the bench: every model's evaluation sets are
deterministic, disjoint from its calibration data and from each other (by source and by content),
and the classifiers have at least two sets each."""

from __future__ import annotations

import hashlib
from itertools import combinations

import numpy as np
import pytest

from bench.bench_quant import SPECS, Row, Spec, summary
from examples import assets

N = 12  # small: the sets are drawn one sample at a time, so a prefix shows the rule


def _digests(inputs: list[np.ndarray]) -> set[str]:
    return {hashlib.sha1(np.ascontiguousarray(x).tobytes()).hexdigest() for x in inputs}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_eval_sets_are_deterministic_named_and_sized(name: str) -> None:
    spec = SPECS[name]
    names = [s.name for s in spec.eval_sets]
    assert names and len(set(names)) == len(names)
    for es in spec.eval_sets:
        x1, y1 = es.make(N)
        x2, y2 = es.make(N)
        assert len(x1) == len(y1) == N
        assert all(np.array_equal(a, b) for a, b in zip(x1, x2, strict=True))
        assert y1 == y2


@pytest.mark.parametrize("name", sorted(SPECS))
def test_eval_sets_share_no_input_with_calibration_or_each_other(name: str) -> None:
    spec = SPECS[name]
    assert spec.calib_inputs is not None
    groups = {"calibration": _digests(spec.calib_inputs(N))}
    groups.update({es.name: _digests(es.make(N)[0]) for es in spec.eval_sets})
    for a, b in combinations(groups, 2):
        assert not groups[a] & groups[b], f"{name}: {a} and {b} share an input"


def test_classifiers_have_two_sets_each() -> None:
    classifiers = [s for s in SPECS.values() if s.name in ("mbv2", "cls")]
    assert len(classifiers) == 2
    assert all(len(s.eval_sets) >= 2 for s in classifiers)


def test_mbv2_sources_are_disjoint() -> None:
    # calibration: first halves of OBJECT_PHOTOS; set "photos": second halves; set "other": whole
    # photos none of the OBJECT_PHOTOS
    assert not set(assets.OTHER_PHOTOS) & set(assets.OBJECT_PHOTOS)
    assert len(assets.other_photo_names()) >= 5
    # the other photos are not copies of an object photo either
    objects = {
        hashlib.sha1(assets.load_photo(p).tobytes()).hexdigest() for p in assets.OBJECT_PHOTOS if p in assets.photo_names()
    }
    others = {hashlib.sha1(assets._try_load_other_photo(p).tobytes()).hexdigest() for p in assets.other_photo_names()}
    assert not objects & others


def test_direction_sources_are_disjoint() -> None:
    vocab = {s: set(assets.direction_vocabulary(s)) for s in ("calib", "eval", "other")}
    for a, b in combinations(vocab, 2):
        assert not vocab[a] & vocab[b], f"words shared by {a} and {b}"
    assert not set(assets._OTHER_FONT_FILES) & set(assets._FONT_FILES)


def test_direction_lines_are_half_upside_down() -> None:
    for style in ("calib", "eval", "other"):
        labels = [label for _, label in assets.direction_lines(N, 5, style=style)]
        assert labels == [i % 2 for i in range(N)]
    x = assets.cls_preprocess(assets.direction_lines(1, 5, style="eval")[0][0])
    assert x.shape == (1, 3, assets.CLS_H, assets.CLS_W) and x.dtype == np.float32


def test_summary_compares_default_with_best_ort_row() -> None:
    spec = Spec("m", "m", None, None, SPECS["cls"].eval_sets, None, keys=("agree",))  # type: ignore[arg-type]
    scores = lambda v: {es.name: {"agree@float": v} for es in spec.eval_sets}  # noqa: E731
    rows = [Row("float", scores(1.0)), Row("pulsar default", scores(0.9)), Row("ORT MinMax", scores(0.8)),
            Row("ORT Percentile", scores(0.85))]
    table, ahead = summary({"m": (spec, rows)}, ["float"])
    assert ahead and "+0.050" in table and "Percentile" in table
    rows[1] = Row("pulsar default", scores(0.84))
    assert not summary({"m": (spec, rows)}, ["float"])[1]
