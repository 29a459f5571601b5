"""Which variants a build compiles (batch sizes, shape groups) and how their lowerings become one model.

- Shape groups: group 0 is the quantized model's own input shape; group ``i`` takes the ``i``-th
  ``input_processors[].src_extra_shapes`` entry of every input (all inputs list the same number).
  The quantization is the one made at group 0's shape; a group only re-shapes the QDQ graph.
- Static multi-batch (``compiler.static_batch_sizes``, per ``sub_configs`` entry too): every listed
  batch is compiled; an NPU subgraph keeps the batches of its own range.
- Dynamic multi-batch (``compiler.max_dynamic_batch_size``): batch 1, 2, 4 ... is lowered while, per NPU
  subgraph, the cost model's time per sample keeps improving and the batch stays within the maximum;
  each subgraph keeps its own set, and why it stopped is logged. The two modes exclude each other.

Every (group, batch) is lowered from the re-shaped QDQ graph (:mod:`pulsar.compiler.variant_graph`);
the lowerings must split the model into the same subgraphs, which then carry one body per variant
they keep (CPU subgraphs keep every batch). Weights are shared in the container by name and content.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import onnx

from pulsar.compiler.lower import LoweredModel
from pulsar.compiler.lower.model import SubRange
from pulsar.compiler.variant_graph import reshaped
from pulsar.core.container import Subgraph, tensor_infos
from pulsar.core.variants import (
    BATCH_AXES_KEY,
    BATCH_MODE_KEY,
    BATCH_SIZES_KEY,
    SHAPE_GROUPS_KEY,
    VARIANTS_KEY,
    Variant,
)
from pulsar.errors import PulsarError
from pulsar.frontend.graph import graph_input_names
from pulsar.frontend.processors.chain import assign

if TYPE_CHECKING:
    from pulsar.config.generated import BuildConfig, CompilerConfig

log = logging.getLogger(__name__)

# lower(model) -> (deployed model, lowering); time(lowering) -> NPU subgraph name -> estimated ms
Lower = Callable[[onnx.ModelProto], tuple[onnx.ModelProto, LoweredModel]]
SubgraphTimes = Callable[[LoweredModel], dict[str, float]]


def _dims(vi: onnx.ValueInfoProto) -> list[int]:
    return [d.dim_value for d in vi.type.tensor_type.shape.dim]


def shape_groups(cfg: BuildConfig, qmodel: onnx.ModelProto) -> list[dict[str, list[int]]]:
    """Input name -> shape, per group (group 0: the quantized model's own shapes)."""
    names = graph_input_names(qmodel.graph)
    own = {vi.name: _dims(vi) for vi in qmodel.graph.input if vi.name in names}
    extra: dict[str, list[list[int]]] = {n: [] for n in names}
    where: dict[str, str] = {}
    for name, index, p in assign(cfg.input_processors, names, "input_processors", "input"):
        extra[name] = [list(e.shape) for e in p.src_extra_shapes]
        where[name] = f"input_processors[{index}].src_extra_shapes"
        for k, shape in enumerate(extra[name]):
            if len(shape) != len(own[name]):
                raise PulsarError(f"{where[name]}[{k}]: shape {shape} has rank {len(shape)}, input {name!r} "
                                  f"{own[name]} has rank {len(own[name])}; give a shape of the model's input layout")
    counts = {n: len(v) for n, v in extra.items()}
    if len(set(counts.values())) > 1:
        listed = ", ".join(f"{n!r}: {c}" for n, c in counts.items())
        raise PulsarError(f"src_extra_shapes: every input needs the same number of extra shapes (group i takes "
                          f"the i-th of each); the inputs list {listed}")
    n_groups = 1 + max(counts.values(), default=0)
    return [own] + [{n: extra[n][g - 1] for n in names} for g in range(1, n_groups)]


@dataclass
class BatchRequest:
    """What the config asks for: per range (None: the top level), static sizes or a dynamic maximum."""

    mode: str | None  # "static" | "dynamic" | None
    static: dict[int | None, list[int]] = field(default_factory=dict)
    maximum: dict[int | None, int] = field(default_factory=dict)

    def for_range(self, sub: int | None) -> tuple[list[int], int]:
        key = sub if sub in self.static or sub in self.maximum else None
        return self.static.get(key, []), self.maximum.get(key, 0)


def batch_request(compiler: CompilerConfig, subs: list[SubRange]) -> BatchRequest:
    req = BatchRequest(None)
    entries: list[tuple[int | None, dict[str, Any], str]] = [
        (None, {"static_batch_sizes": compiler.static_batch_sizes,
                "max_dynamic_batch_size": compiler.max_dynamic_batch_size}, "compiler")]
    entries += [(i, s.options, f"compiler.sub_configs[{i}]") for i, s in enumerate(subs)]
    for key, options, where in entries:
        static = sorted(set(options.get("static_batch_sizes") or []))
        maximum = int(options.get("max_dynamic_batch_size") or 0)
        if static and maximum:
            inherited = " (a sub-config inherits what it leaves unset from compiler)" if key is not None else ""
            raise PulsarError(f"{where}: static_batch_sizes {static} and max_dynamic_batch_size {maximum} exclude each "
                              f"other (static and dynamic multi-batch){inherited}; use one mode")
        req.static[key], req.maximum[key] = static, maximum
    modes = {"static" for s in req.static.values() if s} | {"dynamic" for m in req.maximum.values() if m}
    if len(modes) > 1:
        raise PulsarError("static_batch_sizes and max_dynamic_batch_size are both set (in compiler or its "
                          "sub_configs): static and dynamic multi-batch exclude each other; use one mode")
    req.mode = modes.pop() if modes else None
    return req


@dataclass
class Lowered:
    variant: Variant
    deployed: onnx.ModelProto
    lowering: LoweredModel


def _signature(lowering: LoweredModel) -> list[tuple[str, str, list[str], list[str]]]:
    return [(sg.name, sg.kind, [i.name for i in sg.graph.input], [o.name for o in sg.graph.output])
            for sg in lowering.subgraphs]


def _same_split(base: LoweredModel, other: LoweredModel, variant: Variant) -> None:
    a, b = _signature(base), _signature(other)
    if a == b:
        return
    first = next((x, y) for x, y in zip([*a, None], [*b, None], strict=False) if x != y)
    raise PulsarError(f"{variant}: the model splits into other subgraphs at this shape than at group 0, batch 1 "
                      f"(first difference: {first[0][0] if first[0] else '-'} vs {first[1][0] if first[1] else '-'}); "
                      "variants must share the NPU / CPU split: drop the shape or batch")


def _sub_index(sg: Subgraph) -> int | None:
    value = sg.options.get("sub_config")
    return int(value) if isinstance(value, int) else None


def choose_batches(req: BatchRequest, probe: Lowered, lower_at: Callable[[int], Lowered],
                   times: SubgraphTimes) -> tuple[dict[str, list[int]], dict[int, Lowered]]:
    """NPU subgraph -> its batches, and the lowerings made (group 0) by batch."""
    lowerings = {1: probe}
    npu = [sg for sg in probe.lowering.subgraphs if sg.kind == "npu"]
    if req.mode == "static":
        chosen = {sg.name: req.for_range(_sub_index(sg))[0] or [1] for sg in npu}
        for b in sorted({b for bs in chosen.values() for b in bs} - {1}):
            lowerings[b] = lower_at(b)
        for name, bs in chosen.items():
            log.info("static batch: NPU subgraph %s batches %s", name, bs)
        return chosen, lowerings
    limits = {sg.name: req.for_range(_sub_index(sg))[1] for sg in npu}
    chosen = {name: [1] for name in limits}
    per_sample = times(probe.lowering)
    figures = {name: [f"batch 1: {per_sample[name]:.4g} ms/sample"] for name in limits}
    active = {name for name, m in limits.items() if m > 1}
    reasons = {name: "max_dynamic_batch_size is 1 or unset" for name, m in limits.items() if m <= 1}
    b = 2
    while active:
        if all(b > limits[n] for n in active):
            reasons.update({n: f"batch {b} exceeds max_dynamic_batch_size {limits[n]}" for n in active})
            break
        lowerings[b] = lower_at(b)
        t = times(lowerings[b].lowering)
        for n in sorted(active):
            if b > limits[n]:
                reasons[n] = f"batch {b} exceeds max_dynamic_batch_size {limits[n]}"
                active.discard(n)
                continue
            now = t[n] / b
            figures[n].append(f"batch {b}: {now:.4g} ms/sample")
            if now < per_sample[n]:
                chosen[n].append(b)
                per_sample[n] = now
            else:
                reasons[n] = f"batch {b} is no faster per sample ({now:.4g} >= {per_sample[n]:.4g} ms)"
                active.discard(n)
        b *= 2
    for n in limits:
        log.info("dynamic batch: NPU subgraph %s batches %s (cost model: %s; stopped: %s)", n, chosen[n],
                 ", ".join(figures[n]), reasons.get(n, "-"))
    return chosen, lowerings


def batch_axes(at1: LoweredModel, atb: LoweredModel, b: int) -> dict[str, int]:
    """Border tensor -> the axis that carries the batch (compared at batch 1 and ``b``)."""
    shapes1: dict[str, list[int]] = {}
    shapesb: dict[str, list[int]] = {}
    for lowering, shapes in ((at1, shapes1), (atb, shapesb)):
        for sg in lowering.subgraphs:
            for vi in [*sg.graph.input, *sg.graph.output]:
                shapes.setdefault(vi.name, _dims(vi))
    axes = {}
    for name, s1 in shapes1.items():
        sb = shapesb.get(name, [])
        diff = [a for a, (x, y) in enumerate(zip(s1, sb, strict=False)) if x != y]
        if len(s1) != len(sb) or len(diff) != 1 or sb[diff[0]] != b * s1[diff[0]]:
            raise PulsarError(f"tensor {name!r} between subgraphs has shape {s1} at batch 1 and {sb} at batch {b}: "
                              "no single axis carries the batch, so it cannot be split at run time; compile "
                              "without multi-batch")
        axes[name] = diff[0]
    return axes


@dataclass
class Variants:
    """What a build compiled: the variants in order (variant 0 = group 0 at the largest batch), the
    lowering of each, the batch mode, each NPU subgraph's batches, the border tensors' batch axes."""

    order: list[Variant]
    lowered: dict[Variant, Lowered]
    mode: str | None = None
    batches: dict[str, list[int]] = field(default_factory=dict)
    axes: dict[str, int] = field(default_factory=dict)

    @property
    def several(self) -> bool:
        """Whether the model needs the variant entries (more than one body, or multi-batch)."""
        return len(self.order) > 1 or self.mode is not None

    def keeps(self, sg: Subgraph, batch: int) -> bool:
        """NPU subgraphs keep their own batches, CPU subgraphs every compiled one."""
        return self.mode is None or sg.kind != "npu" or batch in self.batches[sg.name]


def merge(built: Variants) -> list[Subgraph]:
    """One Subgraph per split position with a body per kept variant (first kept one = ``graph``)."""
    order, lowered = built.order, built.lowered
    base = lowered[order[0]].lowering
    merged = []
    for i, sg in enumerate(base.subgraphs):
        ids = [k for k, v in enumerate(order) if built.keeps(lowered[v].lowering.subgraphs[i], v.batch)]
        bodies = [(lowered[order[k]].lowering.subgraphs[i].graph,
                   lowered[order[k]].lowering.subgraphs[i].reference) for k in ids]
        merged.append(Subgraph(sg.name, sg.kind, bodies[0][0], sg.options, bodies[0][1], ids, bodies[1:]))
    return merged


def metadata_for(built: Variants, estimates: dict[Variant, dict[str, Any]]) -> dict[str, object]:
    """The ``pulsar.variants`` / ``shape_groups`` / ``batch_*`` entries (none for a single variant)."""
    variants, lowered, mode, axes = built.order, built.lowered, built.mode, built.axes
    if not built.several:
        return {}
    groups = sorted({v.group for v in variants})
    unit = min(v.batch for v in variants)
    meta: dict[str, object] = {
        VARIANTS_KEY: [{**v.to_json(), "estimate": estimates.get(v, {})} for v in variants],
        SHAPE_GROUPS_KEY: [],
    }
    for g in groups:
        low = lowered[Variant(g, 1)] if Variant(g, 1) in lowered else lowered[Variant(g, unit)]
        ins, outs = tensor_infos(low.lowering.inputs), tensor_infos(low.lowering.outputs)
        if mode is not None:  # one sample per group: axis 0 is the batch
            for t in [*ins, *outs]:
                shape = list(t["shape"])  # type: ignore[call-overload]
                axis = axes.get(str(t["name"]), 0)
                shape[axis] = shape[axis] // low.variant.batch
                t["shape"] = shape
        meta[SHAPE_GROUPS_KEY].append({"inputs": ins, "outputs": outs})  # type: ignore[attr-defined]
    if mode is not None:
        meta[BATCH_MODE_KEY] = mode
        meta[BATCH_SIZES_KEY] = sorted({v.batch for v in variants})
        meta[BATCH_AXES_KEY] = axes
    return meta


def build_variants(cfg: BuildConfig, qmodel: onnx.ModelProto, probe: Lowered, lower: Lower, times: SubgraphTimes,
                   subs: list[SubRange]) -> Variants:
    """Lower every variant the config asks for (``probe``: group 0 at batch 1, already lowered)."""
    groups = shape_groups(cfg, qmodel)
    req = batch_request(cfg.compiler, subs)
    ir_fix = not cfg.compiler.disable_ir_fix
    if req.mode is not None:
        for name, dims in groups[0].items():
            if not dims or dims[0] != 1:
                raise PulsarError(f"multi-batch compilation needs batch 1 in the model: input {name!r} has shape "
                                  f"{dims}; set input_shapes with dim 0 = 1")
        for g, shapes in enumerate(groups[1:], start=1):
            for name, dims in shapes.items():
                if dims[0] != 1:
                    raise PulsarError(f"src_extra_shapes: extra shape {g - 1} of input {name!r} is {dims}; with "
                                      "multi-batch compilation dim 0 is the batch and must be 1")
        if not any(sg.kind == "npu" for sg in probe.lowering.subgraphs):
            field_name = "static_batch_sizes" if req.mode == "static" else "max_dynamic_batch_size"
            raise PulsarError(f"compiler.{field_name}: the model has no NPU subgraph (every op runs on the CPU), "
                              "so there is nothing to compile at several batch sizes; remove the field")
    logged: set[str] = set()

    def at(group: int, batch: int) -> Lowered:
        variant = Variant(group, batch)
        model, fixes = reshaped(qmodel, groups[group], batch=batch, ir_fix=ir_fix, what=str(variant))
        for line in fixes:
            key = line.split(" ->")[0]
            if key not in logged:
                logged.add(key)
                log.info("multi-batch IR fix: %s", line)
        deployed, lowering = lower(model)
        _same_split(probe.lowering, lowering, variant)
        return Lowered(variant, deployed, lowering)

    chosen: dict[str, list[int]] = {}
    axes: dict[str, int] = {}
    group0 = {1: probe}
    mode = req.mode
    if mode is not None:
        chosen, group0 = choose_batches(req, probe, lambda b: at(0, b), times)
        wider = [b for b in sorted(group0) if b > 1]
        if not wider:
            log.info("multi-batch: only batch 1 is compiled; the model is built as a single-batch model")
            mode, chosen = None, {}
        else:
            axes = batch_axes(probe.lowering, group0[wider[0]].lowering, wider[0])
    union = sorted({b for bs in chosen.values() for b in bs}) if mode is not None else [1]
    lowered = {Variant(0, b): group0[b] for b in union}
    for g in range(1, len(groups)):
        log.info("extra input shape, group %d: %s", g, ", ".join(f"{n} {s}" for n, s in groups[g].items()))
        for b in union:
            lowered[Variant(g, b)] = at(g, b)
    order = [Variant(g, b) for g in range(len(groups)) for b in sorted(union, reverse=True)]
    return Variants(order, lowered, mode, chosen, axes)
