"""LayerNorm in any spelled-out form -> ``LayerNormalization``, recognised by what it computes.

:mod:`fuse_layernorm` matches the exporters' usual node patterns. Others write the variance as
``E[x^2] - E[x]^2`` (jax2tf / flax: ``max(0, mean(x*x) - mean(x)^2)``), the mean as ``ReduceSum * 1/N``,
the inverse deviation as ``Reciprocal(Sqrt(.))`` folded with gamma before it meets ``x - mean``, with
Reshape / Expand of the statistics in between. Quantized node by node, such a variance is the
difference of two large, nearly equal 8-bit numbers: noise, and the classifier after it reads
garbage while every per-layer cosine looks fine.

So instead of one more pattern, this pass finds the region a normalization must be: from a
ReduceMean / ReduceSum of ``x`` over any of its axes, the smallest set of nodes that reads only
``x`` and constants and ends in one tensor ``y`` of ``x``'s shape, every inner tensor private to it.
It then runs the region in onnxruntime on random rows (including nearly constant ones, which pin
the epsilon) and fits ``y = gamma * (x - mean) / sqrt(var + eps) + beta`` per feature; a region
that fits to float32 precision is replaced by one ``LayerNormalization``, extended to the furthest
``y`` that still fits (gamma and beta applied later). Statistics over a middle axis (flax's
``reduction_axes=1``, Magika's first LayerNorm) become a LayerNormalization between two Transposes
that move that axis last and back. What does not fit (RMSNorm, a residual sum,
anything else) is left alone, and the pass manager's onnxruntime check guards every rewrite.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from pulsar.frontend.graph import DEFAULT_DOMAINS
from pulsar.frontend.passes.pattern import FusionContext, opset, run_fusion
from pulsar.frontend.passes.registry import register_pass

log = logging.getLogger(__name__)

REDUCTIONS = ("ReduceMean", "ReduceSum")
WINDOW = 48          # nodes after the reduction searched for the region's end
MAX_FITS = 8         # onnxruntime runs per reduction
ROWS = 96            # rows the fit sees
TOLERANCE = 2e-3     # max |fit error| relative to max |y|


def _norm_axes(ctx: FusionContext, node: onnx.NodeProto, rank: int) -> list[int] | None:
    """The axes (positive, sorted) a reduction normalizes over; flax / jax2tf may reduce a middle axis."""
    found = ctx.reduce_axes(node)
    if found is None or not found[0]:
        return None
    axes = sorted({a % rank for a in found[0] if -rank <= a < rank})
    return axes if len(axes) == len(found[0]) else None


def _moved(rank: int, axes: list[int]) -> list[int]:
    """The permutation that puts ``axes`` last (in order): LayerNormalization normalizes trailing axes."""
    return [a for a in range(rank) if a not in axes] + axes


def _window(ctx: FusionContext, x: str, start: int) -> list[onnx.NodeProto]:
    """Nodes (graph order) that depend on ``x``, from the first reader on, at most WINDOW of them."""
    live, out = {x}, []
    for node in ctx.graph.node[start:]:
        if any(i in live for i in node.input):
            out.append(node)
            live.update(o for o in node.output if o)
            if len(out) >= WINDOW:
                break
    return out


def _region(ctx: FusionContext, window: list[onnx.NodeProto], x: str, y: str) -> list[onnx.NodeProto] | None:
    """The nodes of ``window`` that ``y`` depends on, if they read only ``x``, constants and each
    other and nothing outside reads their tensors (``y`` apart)."""
    made = {o: n for n in window for o in n.output if o}
    need, region, seen = [y], [], set()
    while need:
        t = need.pop()
        node = made.get(t)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        region.append(node)
        need.extend(i for i in node.input if i and i != x and i in made)
    ids = {id(n) for n in region}
    for node in region:
        if node.domain not in DEFAULT_DOMAINS or any(a.type in (onnx.AttributeProto.GRAPH,
                                                                 onnx.AttributeProto.GRAPHS) for a in node.attribute):
            return None
        for i in node.input:
            if i and i != x and i not in made and ctx.const(i) is None:
                return None  # reads a run-time tensor from outside
            if i in made and id(made[i]) not in ids:
                return None
        for o in node.output:
            if o and o != y and (o in ctx.outputs or any(id(r) not in ids for r in ctx.readers.get(o, []))):
                return None
    order = {id(n): k for k, n in enumerate(window)}
    return sorted(region, key=lambda n: order[id(n)])


def _rows(shape: list[int], axes: list[int], rng: np.random.Generator) -> list[np.ndarray]:
    """Random inputs of ``shape``: rows (the ``axes`` of one position of the others) with offsets and
    spreads of several sizes, some nearly flat."""
    perm = _moved(len(shape), axes)
    feat = int(np.prod([shape[a] for a in axes]))
    lead = int(np.prod(shape)) // feat
    runs = max(1, min(32, -(-ROWS // lead)))
    moved_shape = [shape[a] for a in perm]
    out = []
    for k in range(runs):
        base = rng.normal(size=(lead, feat))
        offset = rng.uniform(-2, 2, size=(lead, 1))
        spread = rng.uniform(0.3, 3.0, size=(lead, 1))
        if k % 4 == 3:  # nearly flat rows: their variance is of the order of epsilon
            offset, spread = np.zeros((lead, 1)), 10.0 ** rng.uniform(-3.5, -1.5, size=(lead, 1))
        moved = (base * spread + offset).astype(np.float32).reshape(moved_shape)
        out.append(np.ascontiguousarray(np.transpose(moved, np.argsort(perm))))
    return out


def _run(ctx: FusionContext, region: list[onnx.NodeProto], x: str, y: str, shape: list[int],
         inputs: list[np.ndarray]) -> list[np.ndarray] | None:
    consts = {i for n in region for i in n.input if i and i in ctx.inits}
    graph = helper.make_graph(
        region, "norm", [helper.make_tensor_value_info(x, onnx.TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info(y, onnx.TensorProto.FLOAT, None)],
        [ctx.inits[c] for c in sorted(consts)])
    model = helper.make_model(graph, opset_imports=list(ctx.model.opset_import))
    model.ir_version = ctx.model.ir_version
    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        return [sess.run([y], {x: v})[0] for v in inputs]
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own types; no fit then
        log.debug("layernorm region ending in %s does not run alone: %s", y, exc)
        return None


def _fit(xs: list[np.ndarray], ys: list[np.ndarray], axes: list[int],
         eps_candidates: list[float]) -> tuple[float, np.ndarray, np.ndarray] | None:
    """(eps, gamma, beta) with ys = gamma * layernorm(xs over ``axes``, eps) + beta per feature, if one fits."""
    shape = xs[0].shape
    perm = _moved(len(shape), axes)
    feat = int(np.prod([shape[a] for a in axes]))
    if any(b.shape != shape for b in ys):
        return None
    x = np.concatenate([np.transpose(a, perm).reshape(-1, feat) for a in xs]).astype(np.float64)
    y = np.concatenate([np.transpose(b, perm).reshape(-1, feat) for b in ys]).astype(np.float64)
    if y.shape != x.shape or not np.all(np.isfinite(y)):
        return None
    scale = float(np.abs(y).max()) or 1.0
    best = None
    for eps in eps_candidates:
        z = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + eps)
        zc, yc = z - z.mean(0), y - y.mean(0)
        denom = (zc * zc).sum(0)
        gamma = np.where(denom > 0, (zc * yc).sum(0) / np.where(denom > 0, denom, 1.0), 0.0)
        beta = y.mean(0) - gamma * z.mean(0)
        err = float(np.abs(gamma * z + beta - y).max()) / scale
        if best is None or err < best[0]:
            best = (err, eps, gamma, beta)
    if best is None or best[0] > TOLERANCE:
        return None
    return best[1], best[2], best[3]


def _eps_candidates(ctx: FusionContext, region: list[onnx.NodeProto]) -> list[float]:
    found = []
    for n in region:
        if n.op_type in ("Add", "Max", "Clip"):
            for i in n.input[1:] if n.op_type == "Clip" else n.input:
                v = ctx.scalar(i)
                if v is not None and 0.0 < v < 0.1:
                    found.append(v)
    return [*dict.fromkeys(found), 0.0]


def _snap(ctx: FusionContext, region: list[onnx.NodeProto], fitted: np.ndarray,
          norm_shape: tuple[int, ...]) -> np.ndarray:
    """The model's own constant where the fitted gamma / beta is one of them (exact weights), else the fit."""
    scale = float(np.abs(fitted).max()) or 1.0
    for c in {i for n in region for i in n.input if i}:
        value = ctx.const(c)
        if value is None or value.dtype != np.float32 or value.size != fitted.size:
            continue
        flat = value.reshape(-1).astype(np.float64)
        if np.allclose(flat, fitted, rtol=1e-3, atol=1e-4 * scale):
            return value.reshape(norm_shape)
    if np.allclose(fitted, np.round(fitted), atol=1e-5):
        return np.round(fitted)  # ones / zeros where the model has no gamma / beta
    return fitted


def _match(ctx: FusionContext, red: onnx.NodeProto) -> bool:
    x = red.input[0]
    dims = ctx.dims.get(x)
    if dims is None or not dims or not all(isinstance(d, int) and d > 0 for d in dims) or not ctx.is_float32(x) \
            or ctx.const(x) is not None:
        return False
    shape = [d for d in dims if isinstance(d, int)]
    axes = _norm_axes(ctx, red, len(shape))
    if axes is None or int(np.prod([shape[a] for a in axes])) < 2:
        return False
    index = {id(n): k for k, n in enumerate(ctx.graph.node)}
    first = min(index[id(r)] for r in ctx.readers.get(x, [red]))
    window = _window(ctx, x, first)
    rng = np.random.default_rng(0)
    xs = _rows(shape, axes, rng)
    best: tuple[list[onnx.NodeProto], str, float, np.ndarray, np.ndarray] | None = None
    fits = 0
    for node in window:
        if index[id(node)] <= index[id(red)]:
            continue
        y = node.output[0] if node.output else ""
        if not y or ctx.dims.get(y) != dims or not ctx.is_float32(y):
            continue
        region = _region(ctx, window, x, y)
        if region is None or not any(n is red for n in region) or len(region) < 4:
            continue
        if fits >= MAX_FITS:
            break
        fits += 1
        ys = _run(ctx, region, x, y, shape, xs)
        found = _fit(xs, ys, axes, _eps_candidates(ctx, region)) if ys is not None else None
        if found is None:
            if best is not None:
                break  # the region grew past the normalization's affine tail
            continue
        best = (region, y, *found)
    if best is None:
        return False
    region, y, eps, gamma, beta = best
    norm_shape = tuple(shape[a] for a in axes)
    gamma, beta = _snap(ctx, region, gamma, norm_shape), _snap(ctx, region, beta, norm_shape)
    base = ctx.node_name(region, "LayerNormalization")
    weights = {ctx.tensor_name(f"{base}.scale"): np.asarray(gamma, np.float32).reshape(norm_shape),
               ctx.tensor_name(f"{base}.bias"): np.asarray(beta, np.float32).reshape(norm_shape)}
    trailing = axes == list(range(len(shape) - len(axes), len(shape)))
    if trailing:
        nodes = [helper.make_node("LayerNormalization", [x, *weights], [y], name=base, axis=axes[0] - len(shape),
                                  epsilon=float(eps))]
    else:  # normalized axes in the middle: LayerNormalization between two Transposes
        perm = _moved(len(shape), axes)
        t_in, t_out = ctx.tensor_name(f"{base}.in"), ctx.tensor_name(f"{base}.out")
        nodes = [helper.make_node("Transpose", [x], [t_in], name=ctx.node_name(region, "Transpose"), perm=perm),
                 helper.make_node("LayerNormalization", [t_in, *weights], [t_out], name=base, axis=-len(axes),
                                  epsilon=float(eps)),
                 helper.make_node("Transpose", [t_out], [y], name=ctx.node_name(region, "Transpose"),
                                  perm=[int(i) for i in np.argsort(perm)])]
    log.debug("layernorm recognised numerically: %d nodes from %s to %s over axes %s (eps %g)", len(region), x, y,
              axes, eps)
    return ctx.fuse(region, nodes, weights)


@register_pass("fuse_layernorm_any")
def fuse_layernorm_any(model: onnx.ModelProto) -> bool:
    if opset(model) < 17:  # no LayerNormalization before opset 17
        return False
    return run_fusion(model, REDUCTIONS, _match, "LayerNorm (numeric)")

