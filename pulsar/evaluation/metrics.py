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


class Top1(Accumulator):
    def __init__(self) -> None:
        super().__init__(needs_labels=True, class_labels=True)

    def score(self, out: np.ndarray, label: np.ndarray | None, ref: np.ndarray | None) -> float:
        return float(int(np.argmax(_logits(out))) == int(np.asarray(label).reshape(-1)[0]))


class Top5(Accumulator):
    def __init__(self) -> None:
        super().__init__(needs_labels=True, class_labels=True)

    def score(self, out: np.ndarray, label: np.ndarray | None, ref: np.ndarray | None) -> float:
        top = np.argsort(-_logits(out), kind="stable")[:5]
        return float(int(np.asarray(label).reshape(-1)[0]) in top.tolist())


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
        pred = np.argmax(np.asarray(out), axis=1).reshape(-1)
        truth = np.asarray(label).astype(np.int64).reshape(-1)
        if pred.size != truth.size:
            raise ValueError(f"the prediction has {pred.size} pixels, the label mask {truth.size}")
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
