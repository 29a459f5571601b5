"""Per-layer tuning in ``quant.layer_configs`` beyond the precision: a layer's calibration method and
its parameters, its weights' calibration method, its bias bits and its LUT size (Compass's per-layer
``q_strategy_activation``, ``q_bits_bias``, ``lut_items_in_bits`` ...).

Each field is resolved on its own, by the priority the precision uses (a layer name beats an op
type, which beats a subgraph range, which beats the whole model), so an entry sets only what it
names: ``{"op_type": "Conv", "calibration_method": "KL"}`` leaves the Convs' precision alone. Two
entries of the same kind giving one layer different values of a field are an error.

An activation takes the calibration settings of the layer that produces it (graph inputs: the
global ones); a weight and a bias those of the layer that reads them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from pulsar.core.opdefs import table_ops
from pulsar.errors import PulsarError
from pulsar.quant.layer_configs import _KIND, TUNING_FIELDS, _selection, tuning_only_entry

if TYPE_CHECKING:
    from collections.abc import Sequence

    import onnx

    from pulsar.config.generated import LayerConfig, QuantConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Calibration:
    """How one tensor's range is chosen: the method and its parameters."""

    method: str = "MinMax"
    percentile: float = 99.99
    std_n: float = 3.0
    kl_top_n: int = 1
    weighted_alpha: float | None = None

    def kwargs(self) -> dict[str, Any]:
        return {"percentile": self.percentile, "std_n": self.std_n, "kl_top_n": self.kl_top_n,
                "weighted_alpha": self.weighted_alpha}

    def to_json(self) -> dict[str, Any]:
        """The method and the parameters it uses (the others do not act, so they are left out)."""
        used = {"Percentile": ("percentile",), "Std": ("std_n",), "KL": ("kl_top_n",),
                "WeightedScale": ("weighted_alpha",)}.get(self.method, ())
        return {"method": self.method, **{k: getattr(self, k) for k in used}}


@dataclass(frozen=True)
class LayerTuning:
    """One layer's effective settings (globals filled in)."""

    activations: Calibration
    weights: Calibration
    bias_bits: int = 32
    lut_items_in_bits: int | None = None  # None: the compiler's (or its sub_config's)
    explicit: bool = field(default=False, compare=False)  # a layer_configs entry selected the layer


def global_calibration(q: QuantConfig, method: str | None = None) -> Calibration:
    return Calibration(method or q.calibration_method, q.calibration_percentile, q.calibration_std_n,
                       q.calibration_kl_top_n, q.calibration_weighted_alpha)


def resolve_layer_tuning(layer_configs: Sequence[LayerConfig], model: onnx.ModelProto,
                         q: QuantConfig) -> dict[str, LayerTuning]:
    """node name -> its effective tuning, for every node."""
    chosen: dict[str, dict[str, tuple[int, Any, int]]] = {n.name: {} for n in model.graph.node}
    for i, lc in enumerate(layer_configs):
        values = {f: getattr(lc, f) for f in TUNING_FIELDS if getattr(lc, f) is not None}
        if not values:
            continue
        named, ops, ranged, whole = _selection(lc, i, model)
        for n in model.graph.node:
            rank = 4 if n.name in named else 3 if n.op_type in ops else (1 if whole else 2) if n.name in ranged else -1
            if rank < 0:
                continue
            mine = chosen[n.name]
            for f, v in values.items():
                old = mine.get(f)
                if old is not None and old[0] == rank and old[1] != v:
                    raise PulsarError(
                        f"quant.layer_configs[{i}].{f}: layer '{n.name}' ({n.op_type}) is also selected by "
                        f"quant.layer_configs[{old[2]}] with {f} {old[1]!r}, both by {_KIND[rank]}; give the layer "
                        "one value (remove it from one of the entries)")
                if old is None or rank > old[0]:
                    mine[f] = (rank, v, i)
    selected: dict[int, list[str]] = {}
    for name, mine in chosen.items():
        for _rank, _v, i in mine.values():
            selected.setdefault(i, []).append(name)
    act, wts = global_calibration(q), global_calibration(q, q.weight_calibration_method)
    out = {}
    for name, mine in chosen.items():
        v = {f: r[1] for f, r in mine.items()}
        a = replace(act, **{k: v[f"calibration_{k}"] for k in ("percentile", "std_n", "kl_top_n", "weighted_alpha")
                            if f"calibration_{k}" in v})
        out[name] = LayerTuning(
            activations=replace(a, method=v.get("calibration_method", act.method)),
            weights=replace(a, method=v.get("weight_calibration_method", wts.method)),
            bias_bits=v.get("bias_bits", 32), lut_items_in_bits=v.get("lut_items_in_bits"), explicit=bool(v))
    _warn_idle(layer_configs, model, out, selected)
    return out


# a method parameter acts only where a layer it selects uses that method
_PARAM_METHOD = {"calibration_percentile": "Percentile", "calibration_std_n": "Std", "calibration_kl_top_n": "KL",
                 "calibration_weighted_alpha": "WeightedScale"}


def _warn_idle(layer_configs: Sequence[LayerConfig], model: onnx.ModelProto, out: dict[str, LayerTuning],
               selected: dict[int, list[str]]) -> None:
    """One warning per entry field that acts on none of the layers it decides (never silently ignored)."""
    ops = {n.name: (n.domain or "", n.op_type) for n in model.graph.node}
    tables = table_ops() | {("", "Softmax")}
    for i, lc in enumerate(layer_configs):
        nodes = selected.get(i, [])
        for f, method in _PARAM_METHOD.items():
            if getattr(lc, f) is not None and not any(method in (out[n].activations.method, out[n].weights.method)
                                                      for n in nodes):
                log.warning("quant.layer_configs[%d].%s does not act: no layer it decides uses calibration_method "
                            "or weight_calibration_method %s", i, f, method)
        if lc.lut_items_in_bits is not None and not any(ops[n] in tables for n in nodes):
            log.warning("quant.layer_configs[%d].lut_items_in_bits does not act: no layer it decides is computed "
                        "with a lookup table", i)


def is_default(t: LayerTuning, q: QuantConfig) -> bool:
    return t == LayerTuning(global_calibration(q), global_calibration(q, q.weight_calibration_method))


__all__ = ["TUNING_FIELDS", "Calibration", "LayerTuning", "global_calibration", "is_default",
           "resolve_layer_tuning", "tuning_only_entry"]
