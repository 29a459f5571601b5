"""Built-in metrics: each accumulates one sample at a time (memory does not grow with the data).

``top1`` / ``top5`` read an integer label per sample; ``miou`` a class-index mask per sample (the
output's class axis is 1: [1, C, H, W]); ``top1_agreement`` and ``cosine`` compare with the float
model's output on the same sample. All are higher-is-better fractions in [0, 1] (cosine in [-1, 1])."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Accumulator:
    """A metric over samples: ``add`` one output (with its label / float reference), then ``value``."""

    needs_labels: bool = False
    needs_float: bool = False
    class_labels: bool = False  # labels are one class index per sample (top1 / top5)
    total: float = 0.0
    count: int = 0

    def add(self, out: np.ndarray, label: np.ndarray | None, ref: np.ndarray | None) -> None:
        self.total += self.score(out, label, ref)
        self.count += 1

    def score(self, out: np.ndarray, label: np.ndarray | None, ref: np.ndarray | None) -> float:
        raise NotImplementedError

    def value(self) -> float:
        return self.total / max(self.count, 1)


def _logits(out: np.ndarray) -> np.ndarray:
    return np.asarray(out, np.float64).reshape(-1)


def _class(label: np.ndarray | None, classes: int) -> int:
    """The label as a class index of an output with ``classes`` logits (an index outside is never right)."""
    index = int(np.asarray(label).reshape(-1)[0])
    if not 0 <= index < classes:
        raise ValueError(f"the label {index} is not a class index of the output's {classes} classes")
    return index


class Top1(Accumulator):
    def __init__(self) -> None:
        super().__init__(needs_labels=True, class_labels=True)

    def score(self, out: np.ndarray, label: np.ndarray | None, ref: np.ndarray | None) -> float:
        logits = _logits(out)
        return float(int(np.argmax(logits)) == _class(label, logits.size))


class Top5(Accumulator):
    def __init__(self) -> None:
        super().__init__(needs_labels=True, class_labels=True)

    def score(self, out: np.ndarray, label: np.ndarray | None, ref: np.ndarray | None) -> float:
        logits = _logits(out)
        index = _class(label, logits.size)
        return float(index in np.argsort(-logits, kind="stable")[:5].tolist())


class Top1Agreement(Accumulator):
    def __init__(self) -> None:
        super().__init__(needs_float=True)

    def score(self, out: np.ndarray, label: np.ndarray | None, ref: np.ndarray | None) -> float:
        assert ref is not None
        return float(int(np.argmax(_logits(out))) == int(np.argmax(_logits(ref))))


class Cosine(Accumulator):
    def __init__(self) -> None:
        super().__init__(needs_float=True)

    def score(self, out: np.ndarray, label: np.ndarray | None, ref: np.ndarray | None) -> float:
        assert ref is not None
        a, b = _logits(out), _logits(ref)
        na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
        if na == 0 or nb == 0:
            return 1.0 if na == nb else 0.0
        return float(np.dot(a, b) / (na * nb))


@dataclass
class MeanIoU(Accumulator):
    """Intersection and union per class summed over every sample, then averaged over the classes
    that occur (in the labels or the predictions)."""

    inter: dict[int, int] = field(default_factory=dict)
    union: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.needs_labels = True

    def add(self, out: np.ndarray, label: np.ndarray | None, ref: np.ndarray | None) -> None:
        scores = np.asarray(out)
        pred = np.argmax(scores, axis=1).reshape(-1)
        mask = np.asarray(label).reshape(-1)
        if pred.size != mask.size:
            raise ValueError(f"the prediction has {pred.size} pixels, the label mask {mask.size}")
        if mask.dtype.kind == "f" and not np.all(np.isfinite(mask)):
            raise ValueError("the label mask holds NaN / inf")
        truth = mask.astype(np.int64)
        if truth.size and (truth.min() < 0 or truth.max() >= scores.shape[1]):
            raise ValueError(f"the label mask holds class indices outside 0..{scores.shape[1] - 1}")
        for c in np.union1d(np.unique(pred), np.unique(truth)).tolist():
            p, t = pred == c, truth == c
            self.inter[c] = self.inter.get(c, 0) + int(np.count_nonzero(p & t))
            self.union[c] = self.union.get(c, 0) + int(np.count_nonzero(p | t))
        self.count += 1

    def value(self) -> float:
        ious = [self.inter[c] / self.union[c] for c in self.union if self.union[c]]
        return float(np.mean(ious)) if ious else 0.0


BUILTINS: dict[str, Callable[[], Accumulator]] = {
    "top1": Top1, "top5": Top5, "top1_agreement": Top1Agreement, "cosine": Cosine, "miou": MeanIoU,
}
