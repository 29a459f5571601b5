"""Activation ranges: calibration statistics -> one range per quantized activation.

Each activation is ranged by the calibration settings of the layer that produces it
(:mod:`pulsar.quant.layer_tuning`; graph inputs: the global ones), on the grid its dtype gives, then
refined (unless ``quant.disable_auto_refine_scale``) and widened for attention masks. Ranges edited
by hand in a statistics file (:mod:`pulsar.quant.statistics_file`) replace the result last; passive
outputs take their dominator's range.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pulsar.core.float_ops import float_format
from pulsar.errors import PulsarError
from pulsar.quant.algorithms.refine_scale import refine_input_ranges
from pulsar.quant.attention import masked_range, masked_scores, true_scores
from pulsar.quant.calibrate import compute_ranges
from pulsar.quant.layer_tuning import Calibration, LayerTuning, global_calibration
from pulsar.quant.scheme import BITS, DTYPES

if TYPE_CHECKING:
    import onnx

    from pulsar.config.generated import QuantConfig
    from pulsar.quant.plan import QuantPlan

log = logging.getLogger(__name__)


@dataclass
class RangeInputs:
    """What ranges the activations besides their statistics; the ``used`` / ``raw`` / ``range_by``
    dicts are filled by :func:`activation_ranges` (quant_config.json and the statistics file show them)."""

    tuning: dict[str, LayerTuning] = field(default_factory=dict)      # node -> its settings
    in_ir: dict[str, tuple[float, float]] = field(default_factory=dict)  # InIR: the model's own ranges
    edited: dict[str, tuple[float, float]] = field(default_factory=dict)  # hand-edited in a statistics file
    used: dict[str, dict[str, Any]] = field(default_factory=dict)     # activation -> its method, as it acted
    raw: dict[str, tuple[float, float]] = field(default_factory=dict)  # the method's range, before refinement
    range_by: dict[str, dict[str, Any]] = field(default_factory=dict)  # how ``raw`` was computed


def _calibrations(model: onnx.ModelProto, plan: QuantPlan, q: QuantConfig,
                  inputs: RangeInputs) -> dict[str, Calibration]:
    """tensor -> the calibration of its producer; an activation fused into a layer (Conv + Relu writes
    the Relu's output) takes the layer's settings unless an entry selected the activation itself."""
    default = global_calibration(q)
    producer = {o: n.name for n in model.graph.node for o in n.output}
    fused_into = {act: producer.get(skipped) for skipped, act in plan.fused.items()}
    out: dict[str, Calibration] = {}
    for n in model.graph.node:
        t = inputs.tuning.get(n.name)
        if (t is None or not t.explicit) and fused_into.get(n.name) in inputs.tuning:
            t = inputs.tuning[str(fused_into[n.name])]
        for o in n.output:
            out[o] = t.activations if t is not None else default
    return out


def activation_ranges(stats: dict[str, Any], plan: QuantPlan, q: QuantConfig, model: onnx.ModelProto,
                      inputs: RangeInputs | None = None) -> dict[str, tuple[float, float]]:
    """Ranges per activation (see the module docstring)."""
    inputs = inputs if inputs is not None else RangeInputs()
    ranges: dict[str, tuple[float, float]] = {}
    own = [a for a in plan.activations if a not in plan.shared]
    default = global_calibration(q)
    calib = _calibrations(model, plan, q, inputs)

    def grid(a: str) -> tuple[str, bool, Calibration]:  # dtype, symmetric (activation_symmetric, else signed), method
        return plan.dtypes[a], plan.symmetric.get(a, DTYPES[plan.dtypes[a]][2]), calib.get(a, default)

    groups: dict[tuple[str, bool, Calibration], list[str]] = {}
    for a in own:
        if not float_format(plan.dtypes[a]):
            groups.setdefault(grid(a), []).append(a)
    missing_ir = 0
    pinned: dict[str, tuple[float, float]] = {}  # InIR: the model's ranges, which no refinement changes
    for (dtype, symmetric, cal), names in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], repr(kv[0][2]))):
        signed = DTYPES[dtype][2]
        method = cal.method
        if method == "InIR":
            found = {a: inputs.in_ir[a] for a in names if a in inputs.in_ir}
            for a, r in found.items():
                pinned[a] = (-max(-r[0], r[1]), max(-r[0], r[1])) if symmetric else r
                inputs.used[a], inputs.raw[a] = {"method": "InIR"}, pinned[a]
            names = [a for a in names if a not in found]
            missing_ir += len(names)
            method = "MinMax"
        part = {a: stats[a] for a in names}
        got = compute_ranges(part, method, num_bits=BITS[dtype], signed=signed, symmetric=symmetric, **cal.kwargs())
        ranges.update(got)
        used = Calibration(method, cal.percentile, cal.std_n, cal.kl_top_n, cal.weighted_alpha)
        by = {"method": method, "num_bits": BITS[dtype], "signed": signed, "symmetric": symmetric, **cal.kwargs()}
        for a in got:
            inputs.used[a] = {**used.to_json(), **({"instead_of": "InIR"} if cal.method == "InIR" else {})}
            inputs.raw[a], inputs.range_by[a] = got[a], by
    if missing_ir:
        log.info("calibration InIR: %d activations have no range in the model's quantization annotations; "
                 "MinMax ranges them", missing_ir)
    if not q.disable_auto_refine_scale:
        refine_input_ranges(model, plan, stats, ranges)
    ranges.update(pinned)
    _widen_for_masks(stats, plan, model, ranges)
    _apply_edited(plan, inputs, ranges)
    for a in plan.shared:
        ranges[a] = ranges[plan.dominator(a)]  # passive outputs: their input's grid, no requantization
    return ranges


def _widen_for_masks(stats: dict[str, Any], plan: QuantPlan, model: onnx.ModelProto,
                     ranges: dict[str, tuple[float, float]]) -> None:
    mask_floor: dict[str, float] = {}
    masks = masked_scores(model)
    for m in masks:
        quantized = sorted({plan.dominator(t) for t in m.path if t in plan.activations} & ranges.keys())
        if not quantized:
            continue  # the Softmax is float: the mask is added in float before it
        scores_name = true_scores(masks, m)
        scores = ranges.get(scores_name) or (float(stats[scores_name].min), float(stats[scores_name].max))
        top = float(stats[m.output].max) if m.output in stats else scores[1]  # a mask may carry a bias (ALiBi, T5)
        lo, hi = masked_range((scores[0], max(scores[1], top)))
        for t in quantized:
            ranges[t] = (lo, hi)
        log.info("attention mask: %s (%s) quantized over the scores' range %.4g .. %.4g widened to %.4g .. %.4g",
                 ", ".join(quantized), m.node, *scores, lo, hi)
        if m.mask is not None:  # a quantized mask saturates where it pushes any score to the bottom
            mask = plan.dominator(m.mask)
            mask_floor[mask] = min(mask_floor.get(mask, 0.0), lo - hi)
    for mask, floor in mask_floor.items():
        if mask in ranges and ranges[mask][0] < floor:
            log.info("attention mask: %s saturates at %.4g (calibrated %.4g)", mask, floor, ranges[mask][0])
            ranges[mask] = (floor, max(ranges[mask][1], 0.0))


def _apply_edited(plan: QuantPlan, inputs: RangeInputs, ranges: dict[str, tuple[float, float]]) -> None:
    """Hand-edited ranges replace the computed ones; a tensor that takes another's grid cannot have its own."""
    for name, r in sorted(inputs.edited.items()):
        if name in plan.shared:
            raise PulsarError(f"quant.statistics_file: the range of '{name}' was edited, but it shares the grid of "
                              f"'{plan.dominator(name)}' (a passive op passes codes through); edit that tensor's "
                              "range instead")
        if name not in ranges:
            log.warning("quant.statistics_file: the edited range of '%s' does not act: the tensor is not quantized "
                        "on an integer grid in this build", name)
            continue
        log.info("quant.statistics_file: '%s' takes its hand-edited range %.6g .. %.6g (computed %.6g .. %.6g)",
                 name, r[0], r[1], *ranges[name])
        ranges[name] = r
        inputs.used[name] = {"method": "statistics_file"}
