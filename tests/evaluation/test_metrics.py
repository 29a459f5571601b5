"""The built-in metrics on hand-made outputs whose values are known."""

from __future__ import annotations

import numpy as np
import pytest

from pulsar.evaluation.metrics import BUILTINS


def _run(name: str, outs, labels=None, refs=None) -> float:
    acc = BUILTINS[name]()
    for i, out in enumerate(outs):
        acc.add(np.asarray(out, np.float32), None if labels is None else np.asarray(labels[i]),
                None if refs is None else np.asarray(refs[i], np.float32))
    return acc.value()


def test_top1_and_top5() -> None:
    outs = [[[0.1, 0.9, 0.0, 0.0, 0.0, 0.0]], [[0.5, 0.1, 0.2, 0.3, 0.4, 0.05]], [[0, 0, 0, 0, 0, 1.0]]]
    labels = [1, 5, 0]  # right; last of six (outside the top 5); a tie at 0 picks index 0 first
    assert _run("top1", outs, labels) == pytest.approx(1 / 3)
    assert _run("top5", outs, labels) == pytest.approx(2 / 3)


def test_agreement_and_cosine_against_the_float_output() -> None:
    refs = [[1.0, 0.0], [0.0, 2.0]]
    assert _run("top1_agreement", [[0.9, 0.1], [0.8, 0.7]], refs=refs) == pytest.approx(0.5)
    assert _run("cosine", [[2.0, 0.0], [0.0, -1.0]], refs=refs) == pytest.approx(0.0)  # (1 + -1) / 2


def test_mean_iou_sums_over_samples_then_averages_classes() -> None:
    # one 1x2x2x2 prediction (class axis 1) against a 2x2 mask: class 0 IoU 1/2, class 1 IoU 2/3
    out = np.zeros((1, 2, 2, 2), np.float32)
    out[0, 1] = [[1, 1], [1, 0]]  # predicts class 1 at three pixels
    mask = np.array([[1, 1], [0, 0]])
    assert _run("miou", [out], [mask]) == pytest.approx((1 / 2 + 2 / 3) / 2)
    with pytest.raises(ValueError, match="4 pixels, the label mask 3"):
        _run("miou", [out], [np.array([1, 1, 0])])
