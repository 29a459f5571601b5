"""EasyQuant (Wu et al. 2020, arXiv 2006.16669): search scales that keep each layer's output close
to the float one, instead of trusting the calibrated ranges.

Calibration picks a tensor's range from its statistics alone; the scale that best preserves what a
layer computes is often a little different (clipping rare outliers buys resolution for the bulk).
For every quantized Conv / Gemm / MatMul, in graph order:

- The layer runs on its own: its activation inputs are the float model's values for all samples,
  fake-quantized with their *current* Q/DQ parameters (layers do not interact, except that an
  earlier layer's new output scale is a later layer's input scale); weight and bias are dequantized
  from candidate scales; a one-node onnxruntime model (plus the fused Relu / Clip) computes it.
- Objective: cosine between the layer's quantized output ``T`` (after its own Q/DQ) and the float
  model's ``T``, over all samples at once. The float values every layer reads and compares are
  taken in one pass over the samples and kept in memory until their last layer is done.
- ``rounds`` times: the output scale (factors ``grid`` x current scale), then the weight scales per
  output channel. Given the output scale, output channels are independent, so per-channel dot
  products and energies of each candidate give the exact cosine of any per-channel mix; coordinate
  ascent picks the mix. The current state is always a candidate: a layer's cosine never decreases.

Consistency of the exported model: zero points are kept and scales multiplied (for asymmetric U8
this is the grid of the range scaled by the factor: zero stays exactly representable, the zero
point is unchanged). ``W/q`` is requantized from the float weight with the new scale (factors < 1
clip the largest weights: that is the trade EasyQuant makes); ``B/scale`` = input scale x weight
scale and ``B/q`` are recomputed whenever either changed; passive ops that share ``T``'s grid
(Reshape, MaxPool, ... with equal scale and zero point) follow it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from pulsar.core.tensors import shape_matches, tensor_info
from pulsar.errors import PulsarError, did_you_mean
from pulsar.quant.algorithms.qdq_layers import (
    LAYER_OPS,
    QDQ,
    FloatValues,
    Graph,
    Inits,
    Layer,
    Quant,
    Runner,
    bias_fits,
    block_sums,
    broadcast,
    cosine,
    fake_quant,
    find_layers,
    qrange,
    quantize_weight,
)
from pulsar.quant.ops import QUANT_OPS
from pulsar.quant.scheme import MIN_SCALE, TensorQuant, bias_quant

log = logging.getLogger(__name__)

ASCENT_STEPS = 30  # at most; each accepted step raises the cosine, the search stops at the first that does not


@dataclass
class EasyQuantReport:
    """One searched layer. Cosines are over all samples at once; ``cosine_before`` is where the layer's
    search started (earlier layers already updated, so its input grid may have moved)."""

    layer: str              # node name
    tensor: str             # the compared output (after a fused Relu / Clip)
    cosine_before: float
    cosine_after: float
    act_factor: float       # new / original output scale (1.0: output not quantized)
    weight_factor: float    # mean over channels of new / original weight scale (1.0: weight not searched)


class _Search:
    """The alternating scale search of one layer; writes the chosen scales into ``inits``."""

    def __init__(self, layer: Layer, g: Graph, values: FloatValues, runner: Runner, changed: set[str],
                 bias_users: dict[str, list[Layer]]) -> None:
        self.layer, self.g, self.inits, self.runner, self.changed = layer, g, g.inits, runner, changed
        self.bias_users = bias_users  # input scale name -> layers whose bias lives on its grid
        self.acts = [{k: fake_quant(v, self.inits.get(q.scale), self.inits.get(q.zero_point), q.axis)
                      if q is not None else v for k, (f, q) in layer.inputs.items()
                      for v in [values.values[f][b]]} for b in range(len(values.values[layer.out]))]
        self.ref = values.values[layer.out]
        self.current: list[np.ndarray] | None = None
        n_ch = self.inits.get(layer.weight.qdq.scale).size if layer.weight is not None else 1
        out_ch = self.ref[0].shape[LAYER_OPS[layer.node.op_type]] if self.ref[0].ndim else 0
        self.ch_axis = LAYER_OPS[layer.node.op_type] if n_ch > 1 and n_ch == out_ch else None
        self.n_ch = n_ch if self.ch_axis is not None else 1
        self.ff = sum(float(block_sums(r, r, None, 1, [None])[0].sum()) for r in self.ref)

    def weight_bias(self, w_scale: np.ndarray | None) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Dequantized weight and bias for a weight scale (None: the current one)."""
        layer, inits = self.layer, self.inits
        w = b = None
        if layer.weight is not None:
            c = layer.weight
            scale = inits.get(c.qdq.scale) if w_scale is None else w_scale
            zp = inits.get(c.qdq.zero_point)
            q = quantize_weight(c.value, scale, c.qdq.axis, zp.dtype, zp)
            w = ((q.astype(np.float32) - broadcast(zp.astype(np.float32), c.qdq.axis, q.ndim))
                 * broadcast(scale, c.qdq.axis, q.ndim)).astype(np.float32)
        if layer.bias is not None:
            tq, q = self.bias_quant(w_scale)
            b = (q.astype(np.float64) * tq.scale.reshape(q.shape)).astype(np.float32)
        return w, b

    def bias_quant(self, w_scale: np.ndarray | None) -> tuple:
        layer = self.layer
        in_scale = float(self.inits.get(layer.inputs[0][1].scale))
        scale = self.inits.get(layer.w_scale) if w_scale is None else w_scale
        return bias_quant(layer.bias.name, layer.bias.value, in_scale, scale)

    def outputs(self, w_scale: np.ndarray | None = None) -> list[np.ndarray]:
        """Layer outputs (before the output Q/DQ) for a weight scale; None: the current one (cached)."""
        if w_scale is None and self.current is not None:
            return self.current
        w, b = self.weight_bias(w_scale)
        ys = [self.runner(acts, w, b) for acts in self.acts]
        if w_scale is None:
            self.current = ys
        return ys

    def quant(self, scale: np.ndarray | None = None) -> Quant | None:
        """The output Q/DQ with ``scale`` (None: the current one)."""
        q = self.layer.out_qdq
        if q is None:
            return None
        zp = self.inits.get(q.zero_point)
        qmin, qmax = qrange(zp.dtype)
        return float(self.inits.get(q.scale) if scale is None else scale), qmin - float(zp), qmax - float(zp)

    def stats(self, ys: list[np.ndarray], quants: Sequence[Quant | None], *,
              per_channel: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Per candidate Q/DQ (and channel): dot products with the float output, energies of the output."""
        ch_axis, n_ch = (self.ch_axis, self.n_ch) if per_channel else (None, 1)
        dot, qq = np.zeros((len(quants), n_ch)), np.zeros((len(quants), n_ch))
        for y, r in zip(ys, self.ref, strict=True):
            d, e = block_sums(y, r, ch_axis, n_ch, quants)
            dot += d
            qq += e
        return dot, qq

    def act_step(self, factors: np.ndarray) -> tuple[float, float]:
        """Best output scale among factors x current; returns (cosine before, after)."""
        q = self.layer.out_qdq
        s0 = self.inits.get(q.scale)
        ys = self.outputs()
        cands = [np.maximum(s0 * np.float32(f), MIN_SCALE).astype(np.float32) for f in factors]
        group = self.sharing(q)
        users = [u for member in group for u in self.bias_users.get(member.scale, [])]
        valid = [k == 0 or all(bias_fits(u.bias.value, s, self.inits.get(u.w_scale)).all() for u in users)
                 for k, s in enumerate(cands)]
        dot, qq = self.stats(ys, [self.quant(s) for s in cands], per_channel=False)
        cos = [cosine(d.sum(), e.sum(), self.ff) if ok else -np.inf for d, e, ok in zip(dot, qq, valid, strict=True)]
        best = int(np.argmax(cos))  # the first max: ties keep the current scale
        if best:
            for member in group:
                self.inits.set(member.scale, cands[best])
                self.changed.add(member.scale)
        return cos[0], cos[best]

    def sharing(self, q: QDQ) -> list[QDQ]:
        """``q`` and the outputs of passive ops that share its grid (equal scale and zero point)."""
        scale, zp = self.inits.get(q.scale), self.inits.get(q.zero_point)
        group = [q]
        for reader in self.g.readers.get(q.output, []):
            if not getattr(QUANT_OPS.get(reader.op_type), "passive", False):
                continue
            for o in reader.output:
                dq = self.g.output_qdq(o)
                follower = self.g.qdq(dq) if dq is not None else None
                if (follower is not None and np.array_equal(self.inits.get(follower.scale), scale)
                        and np.array_equal(self.inits.get(follower.zero_point), zp)):
                    group += self.sharing(follower)
        return group

    def weight_step(self, factors: np.ndarray) -> tuple[float, float]:
        """Per-channel weight scales (factors x current), coordinate-wise on the exact cosine."""
        s0 = self.inits.get(self.layer.weight.qdq.scale)
        cands = [np.maximum(s0 * np.float32(f), MIN_SCALE).astype(np.float32) for f in factors]
        stats = [self.stats(self.outputs(s if k else None), [self.quant()]) for k, s in enumerate(cands)]
        dot = np.concatenate([d for d, _ in stats])   # (candidates, channels)
        qq = np.concatenate([e for _, e in stats])
        if self.layer.bias is not None:  # a bias beyond int32 on a candidate's grid rules it out
            in_scale = self.inits.get(self.layer.inputs[0][1].scale)
            for k, c in enumerate(cands[1:], 1):
                fits = bias_fits(self.layer.bias.value, in_scale, c)
                dot[k, ~(fits if self.ch_axis is not None else fits.all(keepdims=True))] = -np.inf
        cols = np.arange(dot.shape[1])

        def objective(choice: np.ndarray) -> float:
            return cosine(dot[choice, cols].sum(), qq[choice, cols].sum(), self.ff)

        shared = [objective(np.full(len(cols), k)) for k in range(len(cands))]
        choice = np.full(len(cols), int(np.argmax(shared)))
        best = objective(choice)
        for _ in range(ASCENT_STEPS):
            # Stationarity of D / sqrt(Q): each channel maximises dot - D / (2Q) * energy.
            d, e = dot[choice, cols].sum(), qq[choice, cols].sum()
            if e <= 0:
                break
            proposal = np.argmax(dot - d / (2 * e) * qq, axis=0)
            value = objective(proposal)
            if value <= best:
                break
            choice, best = proposal, value
        new = np.stack(cands)[choice, cols] if self.ch_axis is not None else cands[int(choice[0])]
        if not np.array_equal(new, s0):
            self.set_weight_scale(new)
        return shared[0], best

    def set_weight_scale(self, scale: np.ndarray) -> None:
        c = self.layer.weight
        zp = self.inits.get(c.qdq.zero_point)
        self.current = None
        self.inits.set(c.qdq.scale, scale)
        self.inits.set(c.q, quantize_weight(c.value, scale, c.qdq.axis, self.inits.get(c.q).dtype, zp))
        self.changed.add(c.qdq.scale)

    def sync_bias(self) -> None:
        """B/scale = input scale x weight scale, B/q requantized, when either changed."""
        layer = self.layer
        if layer.bias is None or not {layer.inputs[0][1].scale, layer.w_scale} & self.changed:
            return
        tq, q = self.bias_quant(None)
        self.inits.set(layer.bias.qdq.scale, tq.scale)
        self.inits.set(layer.bias.q, q)

    def run(self, factors: np.ndarray, rounds: int) -> EasyQuantReport:
        layer = self.layer
        a0 = self.inits.get(layer.out_qdq.scale).copy() if layer.out_qdq is not None else None
        w0 = self.inits.get(layer.w_scale).copy() if layer.weight is not None else None
        before = after = None
        for _ in range(rounds):
            for step, active in ((self.act_step, a0 is not None), (self.weight_step, w0 is not None)):
                if active:
                    start, after = step(factors)
                    before = start if before is None else before
        self.sync_bias()
        act_factor = float(self.inits.get(layer.out_qdq.scale) / a0) if a0 is not None else 1.0
        weight_factor = float(np.mean(self.inits.get(layer.w_scale) / w0)) if w0 is not None else 1.0
        return EasyQuantReport(layer.node.name, layer.out, float(before), float(after), act_factor, weight_factor)


def _check_args(float_model: onnx.ModelProto, samples: list[dict[str, np.ndarray]], rounds: int,
                grid: np.ndarray) -> None:
    inits = {t.name for t in float_model.graph.initializer}
    infos = {i.name: tensor_info(i) for i in float_model.graph.input if i.name not in inits}
    if not samples:
        raise PulsarError("easy_quant: no samples; pass at least one dict of model inputs (input name -> array)")
    for i, s in enumerate(samples):
        for name in s:
            if name not in infos:
                raise PulsarError(f'easy_quant: sample {i} has unknown input "{name}"{did_you_mean(name, infos)}; '
                                  f"model inputs: {sorted(infos)}")
        for name, info in infos.items():
            if name not in s:
                raise PulsarError(f'easy_quant: sample {i} lacks input "{name}" (shape {info.shape})')
            arr = np.asarray(s[name])
            if arr.dtype != info.dtype or not shape_matches(info.shape, arr.shape):
                raise PulsarError(f'easy_quant: sample {i} input "{name}" is {arr.dtype} {arr.shape}; the model '
                                  f"expects {info.dtype} {info.shape}")
    if rounds < 1:
        raise PulsarError(f"easy_quant: rounds is {rounds}; use 1 or more")
    if grid.size == 0 or not np.all(np.isfinite(grid)) or np.any(grid <= 0):
        raise PulsarError(f"easy_quant: grid {grid.tolist()} must be non-empty positive scale factors")


def easy_quant(float_model: onnx.ModelProto, qdq_model: onnx.ModelProto, samples: Sequence[dict[str, np.ndarray]],
               *, rounds: int = 2, grid: Sequence[float] = np.linspace(0.5, 1.2, 15),
               progress: Callable[[int], None] | None = None) -> tuple[onnx.ModelProto, list[EasyQuantReport]]:
    """Search the output scale and weight scales of every quantized Conv / Gemm / MatMul; returns the
    updated copy of ``qdq_model`` (the input is untouched) and one report row per searched layer.
    ``float_model`` is the model ``qdq_model`` was exported from; ``samples`` are its inputs.
    ``progress(n)`` is called after the n-th layer."""
    samples = list(samples)
    factors = np.concatenate([[1.0], np.asarray(grid, dtype=np.float64).ravel()])
    _check_args(float_model, samples, rounds, factors[1:])
    start = time.perf_counter()
    qmodel = onnx.ModelProto()
    qmodel.CopyFrom(qdq_model)
    inits = Inits(qmodel)
    g = Graph(float_model, qmodel, inits, caller="easy_quant")
    layers = find_layers(g, qmodel)
    last_use: dict[str, int] = {}
    for idx, layer in enumerate(layers):
        for name in [f for f, _ in layer.inputs.values()] + [layer.out]:
            last_use[name] = idx
    values = FloatValues(float_model, samples, list(last_use))
    bias_users: dict[str, list[Layer]] = {}
    for layer in layers:
        if layer.bias is not None:
            bias_users.setdefault(layer.inputs[0][1].scale, []).append(layer)
    changed: set[str] = set()
    reports = []
    for idx, layer in enumerate(layers):
        runner = Runner(layer, qmodel, inits)
        reports.append(_Search(layer, g, values, runner, changed, bias_users).run(factors, rounds))
        values.release([n for n, i in last_use.items() if i == idx])
        if progress is not None:
            progress(idx + 1)
        r = reports[-1]
        log.debug("easy_quant %s: cosine %.6f -> %.6f (act x%.3f, weight x%.3f)", r.layer, r.cosine_before,
                  r.cosine_after, r.act_factor, r.weight_factor)
    if reports:
        log.info("easy_quant: %d layers, mean cosine %.6f -> %.6f in %.1f s", len(reports),
                 np.mean([r.cosine_before for r in reports]), np.mean([r.cosine_after for r in reports]),
                 time.perf_counter() - start)
    return qmodel, reports


def update_params(params: dict[str, TensorQuant], qmodel: onnx.ModelProto) -> list[str]:
    """Copy the scales ``easy_quant`` wrote into ``qmodel`` back into the per-tensor parameters that
    quant_config.json is written from (zero points never change); returns the names updated."""
    inits = {t.name: t for t in qmodel.graph.initializer}
    updated = []
    for name, tq in params.items():
        t = inits.get(f"{name}/scale")
        if t is None:
            continue
        scale = numpy_helper.to_array(t).astype(np.float32).reshape(np.shape(tq.scale))
        if not np.array_equal(scale, tq.scale):
            tq.scale = scale
            updated.append(name)
    return updated
