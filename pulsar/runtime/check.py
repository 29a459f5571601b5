"""``compiler.check``: run the compiled model's integer program and compare it with a reference.

Run by the build (pulsar/api.py) right after the compiler stage wrote the compiled model, in the same
"compile" step; the NPUBackend precision analysis (:mod:`pulsar.runtime.analysis`) follows it.

- check 1 (all-close) and 3 (cosine >= ``check_cosine_simularity``) compare the bit-exact simulation
  (NPUBackend) with the float QDQ reference (the compiled model's own reference bodies in
  onnxruntime): how far integer arithmetic is from float QDQ math.
- check 2 (all-equal) compares it with an independent integer reference: the QDQ model lowered
  again from its scales, packaged in memory and simulated. Any difference means the compiled file
  does not hold the program its quantization parameters define (a corrupted multiplier, a packaging
  bug), so equality is the right test there.

Each ``compiler.sub_configs`` range is checked with its own options (its check level, check_mode,
tolerances and black list; the compiler section's where it leaves them unset), every tensor outside the
ranges with the compiler section's: ``check: 2`` on one range and check 0 at the top level checks that
range only (:mod:`pulsar.runtime.check_scopes`). compiler/check_result.json records, per range, the
options, the tensors compared and the output differences.

``check_mode`` CheckPerLayer (the default) compares every tensor both runs compute (integer tensors of
NPU subgraphs, float tensors of CPU subgraphs) in execution order, each op fed the reference's values
of its inputs, and names the first one that fails (skipping names that match a
``check_tensor_black_list`` regex). CheckOutput compares the model outputs end to end. Feeding the
reference's inputs matters: a quantized network is chaotic, so one element rounded the other way
early on (float32 QDQ math and exact integer math disagree on ~1e-6 of the elements, on values within
float rounding of a .5 boundary; on 16-bit tensors ~1%) spreads into many differences downstream. End
to end, integer and float QDQ outputs of a deep network differ about as much as the float QDQ run does
from itself when one quantized input code in 10,000 moves by one step (python -m bench.bench_npu):
cosine 0.994-0.998 on MobileNetV2 and the PP-OCRv4 recognizer, where per layer the worst tensor has
cosine 0.99997 and no code differs by more than one step.

A quantized (integer) tensor is compared on its quantization grid, read from the QuantizeLinear that
makes it in the reference (``real = (code - zero_point) * scale``):

- check 1 passes an element within one quantization step of the reference plus ``check_atol`` +
  ``check_rtol`` x |reference| (real units): the step is the rounding difference the two
  arithmetics may have on any element, more is an arithmetic error. Float tensors: ``numpy.allclose``
  with ``check_rtol`` / ``check_atol``.
- check 3 takes the cosine of the dequantized values (the zero point removed: the cosine of raw
  uint8 codes around zero point 128 is near 1 whatever they hold). A tensor whose every element is
  within one step of the reference passes: a tensor of a few small values can have a low cosine
  from one rounding difference.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import onnx.inliner
from onnx import numpy_helper

from pulsar.compiler.lower import LowerOptions, lower_qdq_model
from pulsar.compiler.lower.model import SubRange
from pulsar.context import BuildContext
from pulsar.core.container import CompiledModel, load_compiled, package
from pulsar.core.opdefs import grid_keeping_ops
from pulsar.core.tensor_io import random_inputs
from pulsar.core.tensors import initializer_array
from pulsar.core.variants import Variant, variants_of
from pulsar.errors import PulsarError
from pulsar.quant.analysis.metrics import Accumulator, slice_axes
from pulsar.quant.samples import deployed_sample_dir
from pulsar.runtime.check_scopes import CHECK_FIELDS, Runs, Scope, range_owner, range_subgraphs, scopes_of
from pulsar.runtime.session import Session
from pulsar.ui import plural, show, table
from pulsar.utils.atomic import atomic_write_text
from pulsar.utils.progress import progress_task

if TYPE_CHECKING:
    from pulsar.config.generated import CompilerOptions

log = logging.getLogger(__name__)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0 or nb == 0:
        return 1.0 if na == nb else 0.0
    return float(a @ b / (na * nb))


CHECKS: dict[int, str] = {1: "all-close", 2: "all-equal", 3: "cosine"}


@dataclass(frozen=True)
class Grid:
    """The quantization grid of an integer tensor: ``real = (code - zero_point) * scale``, per tensor or
    along ``axis``."""

    scale: np.ndarray
    zero_point: np.ndarray
    axis: int = 1

    def _along(self, v: np.ndarray, ndim: int) -> np.ndarray:
        if v.size == 1 or ndim == 0:
            return v.reshape(())
        shape = [1] * ndim
        shape[self.axis % ndim] = -1
        return v.reshape(shape)

    def step(self, ndim: int) -> np.ndarray:
        return self._along(self.scale, ndim)

    def real(self, codes: np.ndarray) -> np.ndarray:
        real: np.ndarray = (np.asarray(codes, np.float64) - self._along(self.zero_point, codes.ndim)) \
            * self.step(codes.ndim)
        return real

    def describe(self) -> str:
        if self.scale.size == 1:
            return f"scale {float(self.scale.reshape(())):.6g}, zero point {int(self.zero_point.reshape(()))}"
        return f"per-axis scale along axis {self.axis}"


CODES = Grid(np.ones(1), np.zeros(1))  # an integer tensor whose grid is unknown: compared in codes


def _constants(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    out = {t.name: initializer_array(t) for t in graph.initializer}
    for n in graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            out[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    return out


# ops that move integer codes without changing them: their outputs are on their (first) input's grid
# (a per-tensor one: a per-axis grid's axis may move); pulsar/core/opdefs.py ``keeps_grid``
_MOVES = grid_keeping_ops()


def quant_grids(compiled: CompiledModel) -> dict[str, Grid]:
    """Tensor name -> quantization grid for every tensor a QuantizeLinear makes (in NPU reference bodies
    and CPU bodies) and the data movement after it."""
    grids: dict[str, Grid] = {}
    for sg in compiled.subgraphs:
        bodies = [sg.reference, *(r for _, r in sg.extra)] if sg.kind == "npu" else [sg.graph, *(b for b, _ in sg.extra)]
        for body in bodies:
            if body is None:
                continue
            consts = _constants(body)
            for n in body.node:
                if n.op_type == "QuantizeLinear" and n.input[1] in consts:
                    zp = consts.get(n.input[2]) if len(n.input) > 2 and n.input[2] else None
                    scale = np.asarray(consts[n.input[1]], np.float64).ravel()
                    axis = next((a.i for a in n.attribute if a.name == "axis"), 1)
                    grids.setdefault(n.output[0], Grid(scale, np.zeros(1) if zp is None else
                                                       np.asarray(zp, np.float64).ravel(), axis))
                elif n.op_type in _MOVES and n.input and n.input[0] in grids and grids[n.input[0]].scale.size == 1:
                    for o in n.output:
                        if o:
                            grids.setdefault(o, grids[n.input[0]])
    return grids


def _at(a: np.ndarray, flat: int) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(flat, a.shape)) if a.ndim else ()


def _all_close(got: np.ndarray, want: np.ndarray, grid: Grid | None, c: CompilerOptions) -> str | None:
    """None, or why check 1 fails: the worst element, its distance and the allowed one."""
    if grid is None:
        g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
        diff, allowed = np.abs(g - w), c.check_atol + c.check_rtol * np.abs(w)
        bad = ~(diff <= allowed)
        if not bad.any():
            return None
        k = int(np.argmax(np.where(bad, diff - allowed, -np.inf)))
        return (f"{int(bad.sum())} of {bad.size} elements outside check_atol {c.check_atol:g} + check_rtol "
                f"{c.check_rtol:g} x |reference|; worst at {_at(g, k)}: {g.flat[k]:.6g} vs {w.flat[k]:.6g}, "
                f"|difference| {diff.flat[k]:.6g} > allowed {allowed.flat[k]:.6g}")
    codes = np.abs(np.asarray(got, np.int64) - np.asarray(want, np.int64))
    step = np.broadcast_to(grid.step(codes.ndim), codes.shape)
    allowed = 1 + (c.check_atol + c.check_rtol * np.abs(grid.real(want))) / step
    bad = codes > allowed
    if not bad.any():
        return None
    k = int(np.argmax(np.where(bad, codes - allowed, -np.inf)))
    return (f"{int(bad.sum())} of {bad.size} elements further than one quantization step + check_atol "
            f"{c.check_atol:g} + check_rtol {c.check_rtol:g} x |reference| from the reference; worst at "
            f"{_at(codes, k)}: code {int(got.flat[k])} vs {int(want.flat[k])}, {int(codes.flat[k])} steps apart > "
            f"allowed {allowed.flat[k]:.4g} ({grid.describe()})")


def _cosine_ok(got: np.ndarray, want: np.ndarray, grid: Grid | None, c: CompilerOptions) -> str | None:
    """None, or why check 3 fails: the cosine (of dequantized values for an integer tensor) and the threshold."""
    if grid is None:
        value = cosine(got, want)
        return None if value >= c.check_cosine_simularity else \
            f"cosine {value:.6f} < check_cosine_simularity {c.check_cosine_simularity:g}"
    value = cosine(grid.real(got), grid.real(want))
    codes = np.abs(np.asarray(got, np.int64) - np.asarray(want, np.int64))
    if value >= c.check_cosine_simularity:
        return _slice_cosine_ok(grid.real(got), grid.real(want), codes, c)
    if codes.max(initial=0) <= 1:
        return None  # rounding differences only
    return (f"cosine {value:.6f} of the dequantized values < check_cosine_simularity "
            f"{c.check_cosine_simularity:g} ({grid.describe()}; {int(np.count_nonzero(codes))} of {codes.size} "
            f"codes differ, by up to {int(codes.max())} steps)")


def _slice_cosine_ok(got: np.ndarray, want: np.ndarray, codes: np.ndarray, c: CompilerOptions) -> str | None:
    """None, or why a slice (channel / last-axis index) of an integer tensor fails check 3 although the
    whole tensor passes: its cosine is below the threshold and its codes differ by more than one step."""
    if not slice_axes(tuple(got.shape)):
        return None
    acc = Accumulator()
    acc.add(want, got)
    for s in sorted(acc.slice_scores(), key=lambda t: t.cosine):
        if s.cosine >= c.check_cosine_simularity:
            break
        worst = int(np.take(codes, s.index, axis=s.axis).max(initial=0))
        if worst > 1:
            return (f"slice axis {s.axis} [{s.index}]: cosine {s.cosine:.6f} of the dequantized values < "
                    f"check_cosine_simularity {c.check_cosine_simularity:g} (codes differ by up to {worst} steps "
                    "there) while the whole tensor passes")
    return None


def verdict(check: int, got: np.ndarray, want: np.ndarray, grids: dict[str, Grid], name: str, c: CompilerOptions) -> str | None:
    """None when ``got`` passes ``compiler.check`` ``check`` against ``want``, else a one-line reason naming the
    measured value and the threshold. An integer tensor is compared on its grid (``grids``; in codes when
    its grid is unknown)."""
    if got.shape != want.shape:
        return f"shape {got.shape} vs {want.shape}"
    if check == 2:
        return None if np.array_equal(got, want) else _describe(got, want)
    integer = np.issubdtype(got.dtype, np.integer) and np.issubdtype(want.dtype, np.integer)
    grid = grids.get(name, CODES) if integer else None
    return _all_close(got, want, grid, c) if check == 1 else _cosine_ok(got, want, grid, c)


def check_samples(ctx: BuildContext, session: Session) -> list[dict[str, np.ndarray]]:
    """compiler.input_sample_dir (the deployed format, read as quant.input_sample_dir is); else calibration
    samples when the compiled inputs are the model's own, else seeded random deployed inputs (processors
    changed the inputs)."""
    sample_dir = ctx.cfg.compiler.input_sample_dir
    model = ctx.model
    if model is None:
        raise PulsarError("compiler.check: the build has no model to check against")
    if not sample_dir:
        own = [(i.name, tuple(d.dim_value for d in i.type.tensor_type.shape.dim), i.type.tensor_type.elem_type)
               for i in model.graph.input]
        deployed = [(i.name, tuple(i.shape), onnx.helper.np_dtype_to_tensor_dtype(i.dtype)) for i in session.inputs]
        if own == deployed and ctx.check_samples:
            return ctx.check_samples
        return [random_inputs(session.inputs, seed=i) for i in range(2)]
    return list(deployed_sample_dir("compiler.input_sample_dir", sample_dir, model, session.inputs))


def lowered_session(qdq_model: onnx.ModelProto, path: Path, options: LowerOptions) -> Session:
    """``qdq_model`` lowered with ``options``, packaged at ``path`` and opened in the simulator."""
    if qdq_model.functions:
        qdq_model = onnx.inliner.inline_local_functions(qdq_model)
    lowered = lower_qdq_model(qdq_model, options)
    for sg in lowered.subgraphs:
        sg.reference = lowered.references.get(sg.name)
    package(lowered.subgraphs, inputs=lowered.inputs, outputs=lowered.outputs, opset_imports=lowered.opset_imports,
            metadata={}, path=path, ir_version=qdq_model.ir_version)
    return Session(path, mode="NPUBackend")


def integer_reference(deployed: onnx.ModelProto, path: Path, lut_items_in_bits: int = 10,
                      sub_configs: list[SubRange] | None = None, cpu_nodes: dict[str, str] | None = None) -> Session:
    """The QDQ model lowered again and packaged at ``path``: check 2's independent reference (with the
    compiled model's sub-config ranges, whose options change the integer program, and its CPU ops)."""
    return lowered_session(deployed, path, LowerOptions(lut_items_in_bits=lut_items_in_bits,
                                                        sub_configs=list(sub_configs or []),
                                                        cpu_nodes=dict(cpu_nodes or {})))


def _describe(got: np.ndarray, want: np.ndarray) -> str:
    diff = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    return f"max abs diff {diff.max() if diff.size else 0:.6g}, cosine {cosine(got, want):.6f}, " \
           f"{int(np.count_nonzero(diff))} of {diff.size} elements differ"


def compare(sim: Session, ref: Session, samples: list[dict[str, np.ndarray]], c: CompilerOptions,
            ref_name: str, progress: Callable[[int], None] | None = None) -> tuple[list[tuple[int, str, str]], int]:
    """Compare ``sim`` with ``ref`` per ``c.check`` / ``c.check_mode`` over the whole model; raise on the
    first failure. Returns table rows (one per output and sample) and the number of tensor comparisons;
    ``progress(n)`` is called after the n-th sample."""
    (result,) = compare_scopes(sim, {Scope(c).reference: (ref, ref_name)}, samples, [Scope(c)], progress)
    return result.rows, result.compared


@dataclass
class ScopeResult:
    """What one scope's check compared: table rows (its output tensors per sample), the comparisons and
    the tensors they covered."""

    scope: Scope
    rows: list[tuple[int, str, str]] = field(default_factory=list)
    compared: int = 0
    tensors: list[str] = field(default_factory=list)


def _selected(scope: Scope, runs: Runs, owner: dict[str, int], split: set[str]
              ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], list[str], list[str]]:
    """(simulated, reference, tensors to compare, tensors shown in the table) of ``scope`` for one sample."""
    c, kind, feed = scope.c, scope.reference, runs.feed
    if c.check_mode == "CheckPerLayer":
        black = [re.compile(p) for p in c.check_tensor_black_list]
        want = runs.reference_all(kind)
        got = runs.isolated(kind)
        names = [t for t in got if t in want and t not in feed and t not in split and scope.holds(t, owner)
                 and not any(b.search(t) for b in black)]
        shown = [o.name for o in runs.sim.outputs] if scope.sub is None else range_subgraphs(runs.sim.compiled,
                                                                                              scope.sub)[1]
        return got, want, names, shown
    if scope.sub is None:
        got, want = runs.outputs(kind)
        return got, want, list(got), list(got)
    outs = range_subgraphs(runs.sim.compiled, scope.sub)[1]
    return runs.fed(kind, scope.sub), runs.reference_all(kind), outs, outs


def compare_scopes(sim: Session, refs: dict[str, tuple[Session, str]], samples: list[dict[str, np.ndarray]],
                   scopes: list[Scope], progress: Callable[[int], None] | None = None) -> list[ScopeResult]:
    """Compare ``sim`` with the reference each scope's check level needs (``refs``: "integer" / "float" ->
    session, name), every scope with its own options; raise on the first failure, naming the range."""
    owner = range_owner(sim.compiled)
    results = [ScopeResult(s) for s in scopes if s.c.check]
    grids = quant_grids(sim.compiled) if any(s.c.check != 2 for s in scopes) else {}
    sessions = {k: s for k, (s, _) in refs.items()}
    for i, feed in enumerate(samples):
        runs = Runs(sim, sessions, feed)
        # a subgraph run as several smaller compiled batches was checked per layer at those batches
        split = sim.split_outputs(next(iter(feed.values())).shape[0]) if sim.view.multi_batch else set()
        for r in results:
            c = r.scope.c
            got, want, names, shown = _selected(r.scope, runs, owner, split)
            for t in names:
                r.compared += 1
                why = verdict(c.check, got[t], want[t], grids, t, c)
                if why is not None:
                    what = "tensor" if c.check_mode == "CheckPerLayer" else "output"
                    where = f" in {r.scope.label}" if r.scope.label else ""
                    raise PulsarError(f"compiler.check {c.check} ({CHECKS[c.check]}, {c.check_mode}) failed on {what} "
                                      f"'{t}' of sample {i}{where} against the {refs[r.scope.reference][1]}: {why}")
            r.tensors += [t for t in names if t not in r.tensors]
            r.rows += [(i, t, _describe(got[t], want[t])) for t in shown if t in got and t in want]
        if progress is not None:
            progress(i + 1)
    return results


def _stack(samples: list[dict[str, np.ndarray]], batch: int) -> list[dict[str, np.ndarray]]:
    """``batch`` samples (cycled) stacked on axis 0, as few feeds as cover every sample once."""
    if batch == 1:
        return samples
    count = max(1, -(-len(samples) // batch))
    return [{k: np.concatenate([samples[(j * batch + i) % len(samples)][k] for i in range(batch)])
             for k in samples[0]} for j in range(count)]


def check_compiled(ctx: BuildContext, compiled: Path, deployed: onnx.ModelProto,
                   sub_configs: list[SubRange] | None = None, cpu_nodes: dict[str, str] | None = None,
                   variants: dict[Variant, onnx.ModelProto] | None = None) -> None:
    """Run ``compiler.check`` on every variant of the compiled model (each shape group at each compiled
    batch), each ``sub_configs`` range with its own check options (check_scopes); a failure is a
    PulsarError naming the variant, the range and the tensor. ``sub_configs`` / ``cpu_nodes``: as the
    compiled model was lowered (check 2 lowers each variant's graph again). Writes
    compiler/check_result.json: per scope, its options and what it compared."""
    c = ctx.cfg.compiler
    scopes = scopes_of(c, list(sub_configs or []))
    active = [s for s in scopes if s.c.check]
    for s in scopes:
        if not s.c.check:
            log.info("compiler check: %s not checked (check 0)", s.label or "the model")
    if not active:
        return
    loaded = load_compiled(compiled)
    listed = variants_of(loaded.metadata)
    deployed_of = dict(variants or {}) or {Variant(0, 1): deployed}
    several = len(listed) > 1
    results = [ScopeResult(s) for s in active]
    total = 0
    for group in sorted({v.group for v in listed}):
        sim = Session(loaded, mode="NPUBackend", group=group)
        samples = check_samples(ctx, sim) if group == 0 else [random_inputs(sim.inputs, seed=i) for i in range(2)]
        if not samples:
            raise PulsarError("compiler.check: no samples to check with; set compiler.input_sample_dir")
        for batch in sorted({v.batch for v in listed if v.group == group}):
            variant = Variant(group, batch)
            feeds = _stack(samples, batch) if sim.view.multi_batch else samples
            refs: dict[str, tuple[Session, str]] = {}
            if any(s.reference == "integer" for s in active):
                refs["integer"] = (integer_reference(deployed_of.get(variant, deployed),
                                                     ctx.path("compiler", "check_reference.pulsar"),
                                                     c.lut_items_in_bits, sub_configs, cpu_nodes),
                                   "integer reference re-lowered from the QDQ model")
            if any(s.reference == "float" for s in active):
                refs["float"] = (Session(loaded, mode="Reference", group=group), "float QDQ reference")
            label = f" ({variant})" if several else ""
            levels = sorted({(s.c.check, s.c.check_mode) for s in active})
            n = plural(len(feeds), "sample")
            what = (f"compiler check {levels[0][0]} ({CHECKS[levels[0][0]]}, {levels[0][1]}, {n}){label}"
                    if len(levels) == 1 else "compiler check " + " and ".join(
                        f"{k} ({CHECKS[k]}, {m})" for k, m in levels) + f" by range ({n}){label}")
            try:
                with progress_task(ctx.stages, what, len(feeds)) as task:
                    got = compare_scopes(sim, refs, feeds, active, progress=task)
            except PulsarError as exc:
                raise PulsarError(f"{variant}: {exc}" if several else str(exc)) from None
            for acc, r in zip(results, got, strict=True):
                acc.rows += [(i, f"{o}{label}", d) for i, o, d in r.rows]
                acc.compared += r.compared
                acc.tensors += [t for t in r.tensors if t not in acc.tensors]
            total += len(feeds)
    _report(ctx, scopes, results, total, len(listed) if several else 0)


def _report(ctx: BuildContext, scopes: list[Scope], results: list[ScopeResult], samples: int,
            variants: int) -> None:
    """One table and log line per checked scope, and compiler/check_result.json."""
    entries = []
    for s in scopes:
        c, r = s.c, next((x for x in results if x.scope is s), None)
        on = f" on {s.label}" if s.label else ""
        entry: dict[str, Any] = {"range": s.label or "model", "sub_config": s.sub,
                                 "start_tensor_names": list(s.start), "end_tensor_names": list(s.end),
                                 **{f: list(v) if isinstance(v := getattr(c, f), tuple) else v for f in CHECK_FIELDS}}
        if r is None:
            entries.append({**entry, "result": "not checked (check 0)", "comparisons": 0, "tensors": []})
            continue
        entries.append({**entry, "result": "pass", "comparisons": r.compared, "tensors": r.tensors,
                        "outputs": [{"sample": i, "tensor": o, "difference": d} for i, o, d in r.rows]})
        of = f" of {s.label}" if s.label else ""
        show(table(f"Compiler check {c.check} ({CHECKS[c.check]}, {c.check_mode}){of} vs "
                   f"{'the references' if c.check == 2 else 'float QDQ reference'}: pass",
                   ["sample", "output", "difference"], r.rows), quiet=ctx.quiet)
        log.info("compiler check %d passed%s: %d tensor comparisons over %s%s", c.check, on, r.compared,
                 plural(samples, "sample"), f" in {variants} variants" if variants else "")
    path = atomic_write_text(ctx.path("compiler", "check_result.json"),
                             json.dumps({"samples": samples, "scopes": entries}, indent=2) + "\n")
    ctx.artifacts["compiler check result"] = path
