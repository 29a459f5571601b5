"""The quantized graph: the quant stage's one source of truth.

One object holds the float graph, its current weights (fine-tuning changes them), the plan (which
tensors are quantized, at which dtype, which scale each passive tensor shares, where each op runs),
the per-node precision and, per quantized tensor, its :class:`TensorQuant`. Calibration,
placement, layer_configs, SmoothQuant, EasyQuant, mixed precision and fine-tuning read and write it;
``quant/quantized.onnx`` and ``quant/quant_config.json`` are exports of it (:meth:`to_qdq`,
:meth:`to_json`), so no second copy of the parameters has to be kept in sync with a file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from pulsar.core.handoff import LUT_BITS_KEY
from pulsar.quant.layer_tuning import LayerTuning
from pulsar.quant.plan import QuantPlan
from pulsar.quant.precision import NodePrecision
from pulsar.quant.qdq import export_qdq, quant_params
from pulsar.quant.scheme import TensorQuant

QUANT_JSON_VERSION = 1


@dataclass
class QuantGraph:
    """Float graph + per-tensor quantization parameters + per-node precision."""

    model: onnx.ModelProto                       # the float graph (initializers: the original weights)
    plan: QuantPlan
    precision: dict[str, NodePrecision]
    params: dict[str, TensorQuant]
    bias_fp32: bool = False
    weights: dict[str, np.ndarray] = field(default_factory=dict)  # weights changed by an algorithm
    # per-node tuning beyond the precision (layer_configs: calibration methods, bias bits, LUT size)
    tuning: dict[str, LayerTuning] = field(default_factory=dict)
    calibration: dict[str, dict[str, Any]] = field(default_factory=dict)  # activation -> its method, as used

    @classmethod
    def calibrated(cls, model: onnx.ModelProto, plan: QuantPlan, precision: dict[str, NodePrecision],
                   ranges: dict[str, tuple[float, float]], *, bias_fp32: bool = False,
                   refine_weight_threshold: float = 1e-6,
                   fixed: dict[str, TensorQuant] | None = None,
                   tuning: dict[str, LayerTuning] | None = None) -> QuantGraph:
        """Parameters from calibrated activation ranges and the weights' own ranges (``fixed`` ones kept)."""
        params = quant_params(model, plan, ranges, bias_fp32=bias_fp32, fixed=fixed,
                              refine_weight_threshold=refine_weight_threshold, tuning=tuning)
        return cls(model, plan, precision, params, bias_fp32, tuning=dict(tuning or {}))

    # ---- reading -------------------------------------------------------------------------------
    def initializer(self, name: str) -> np.ndarray:
        """Current value of a constant (a fine-tuned weight, else the float graph's)."""
        if name in self.weights:
            return self.weights[name]
        for t in self.model.graph.initializer:
            if t.name == name:
                return numpy_helper.to_array(t)
        raise KeyError(name)

    def shares(self, name: str) -> list[str]:
        """Tensors on the grid of ``name`` (itself and every passive tensor dominated by it)."""
        return [t for t in self.params if self.plan.dominator(t) == name]

    # ---- writing -------------------------------------------------------------------------------
    def set_scale(self, name: str, scale: np.ndarray) -> None:
        """New scale for ``name`` and for every tensor sharing its grid; biases fed by it are
        re-derived at export (their scale is input scale x weight scale)."""
        for t in self.shares(self.plan.dominator(name)):
            self.params[t].scale = np.asarray(scale, dtype=np.float32).reshape(np.shape(self.params[t].scale))

    def set_weight(self, name: str, value: np.ndarray) -> None:
        self.weights[name] = np.asarray(value, dtype=np.float32)

    def rederive_biases(self, refine_weight_threshold: float = 1e-6) -> None:
        """Bias grids follow the current input and weight scales."""
        keep = {k: v for k, v in self.params.items() if v.kind != "bias"}
        ranges = {a: self.params[a].range or (0.0, 0.0) for a in self.plan.activations}
        self.params = quant_params(self.current_model(), self.plan, ranges, bias_fp32=self.bias_fp32, fixed=keep,
                                   refine_weight_threshold=refine_weight_threshold, tuning=self.tuning)

    # ---- exports -------------------------------------------------------------------------------
    def current_model(self) -> onnx.ModelProto:
        """The float graph with the current weights."""
        if not self.weights:
            return self.model
        out = onnx.ModelProto()
        out.CopyFrom(self.model)
        for t in out.graph.initializer:
            if t.name in self.weights:
                t.CopyFrom(numpy_helper.from_array(self.weights[t.name].astype(numpy_helper.to_array(t).dtype),
                                                   t.name))
        return out

    def to_qdq(self) -> onnx.ModelProto:
        """The QDQ ONNX export (``quant/quantized.onnx``)."""
        model = export_qdq(self.current_model(), self.plan, self.params)
        luts = {n: t.lut_items_in_bits for n, t in self.tuning.items() if t.lut_items_in_bits is not None}
        for node in model.graph.node:  # the compiler's lowering reads a layer's LUT size here
            if node.name in luts:
                node.metadata_props.add(key=LUT_BITS_KEY, value=str(luts[node.name]))
        return model

    def _tensor_tuning(self, name: str, tq: TensorQuant) -> dict[str, Any]:
        """The effective per-layer settings that made this tensor's grid (quant_config.json)."""
        if tq.kind == "weight":
            use = next((w for w in self.plan.weights if w.tensor == name), None)
            t = self.tuning.get(use.node) if use is not None else None
            return {"calibration": t.weights.to_json()} if t is not None else {}
        if tq.kind == "bias":
            b = next((b for b in self.plan.biases if b.tensor == name), None)
            t = self.tuning.get(b.node) if b is not None else None
            return {"bias_bits": t.bias_bits} if t is not None else {}
        if name in self.calibration:
            return {"calibration": self.calibration[name]}
        return {}

    def to_json(self, calibration_method: str, activation_dtype: str) -> dict[str, Any]:
        """The per-tensor / per-node export (``quant/quant_config.json``)."""
        plan = self.plan
        nodes = {}
        for n in self.model.graph.node:
            nodes[n.name] = {"op_type": n.op_type, "inputs": list(n.input), "outputs": list(n.output),
                             "placement": plan.placement[n.name][0], "placement_reason": plan.placement[n.name][1],
                             **({"fused_into": plan.fused[n.output[0]]} if n.output and n.output[0] in plan.fused
                                else {})}
            t = self.tuning.get(n.name)
            if t is not None and t.lut_items_in_bits is not None:
                nodes[n.name]["lut_items_in_bits"] = t.lut_items_in_bits
        return {
            "version": QUANT_JSON_VERSION,
            "calibration_method": calibration_method,
            "activation_dtype": activation_dtype,
            "conventions": "real = (q - zero_point) * scale; q clipped to [quant_min, quant_max]",
            "tensors": {name: {**tq.to_json(), **self._tensor_tuning(name, tq)} for name, tq in self.params.items()},
            "nodes": nodes,
        }
