"""Which tensors the calibration pass collects, and the statistics of the ones it leaves out.

Every float activation may be quantized in some build of a model (the cache and the statistics file
hold them all), but a tensor that lives only inside a fused op (a Conv's output feeding its Relu /
Clip, a link of a lookup-table chain) gets no range in this build. On CNNs these are a third of the
activations and the largest ones: exposing them as outputs also stops onnxruntime from fusing the
Conv with its activation. The pass therefore leaves them out, and :class:`DeferredStats` runs a
second pass for all of them should anything read one after all (a preset that breaks a fusion): the
result is the same, only slower.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import onnx

from pulsar.quant.observers.histogram import TensorStats
from pulsar.quant.plan import make_plan
from pulsar.quant.precision import NodePrecision

log = logging.getLogger(__name__)

Fill = Callable[[list[str]], dict[str, TensorStats]]


def fused_away(model: onnx.ModelProto, precision: dict[str, NodePrecision], **plan_kw: Any) -> set[str]:
    """Activations the plan of ``precision`` fuses into the op that reads them (no range of their own)."""
    return set(make_plan(model, precision, **plan_kw).fused)


class DeferredStats(dict[str, TensorStats]):
    """The pass's statistics, by tensor name; a read of a ``deferred`` tensor (item, ``get`` or ``in``)
    first collects all deferred tensors with ``fill`` (one more pass over the calibration data)."""

    def __init__(self, stats: dict[str, TensorStats], deferred: Iterable[str], fill: Fill) -> None:
        super().__init__(stats)
        self.deferred = {n for n in deferred if n not in stats}
        self._fill = fill

    def _collect(self) -> None:
        names = sorted(self.deferred)
        log.info("calibration: %d fused tensors are needed after all (%s ...): one more pass", len(names),
                 names[0])
        self.update(self._fill(names))
        self.deferred = set()  # after the pass: a failed one leaves them deferred, not silently missing

    def __missing__(self, key: str) -> TensorStats:
        if key not in self.deferred:
            raise KeyError(key)
        self._collect()
        return dict.__getitem__(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        if key in self.deferred:
            self._collect()
        return dict.get(self, key, default)

    def __contains__(self, key: object) -> bool:
        return dict.__contains__(self, key) or key in self.deferred
