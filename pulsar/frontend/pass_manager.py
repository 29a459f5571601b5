"""Run the frontend passes to a fixed point, verifying every change in onnxruntime.

A graph rewrite that silently changes the numbers would surface much later as "quantization lost
accuracy"; checking each pass against the graph before it pins a bug to the pass that caused it.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from pulsar.core.graph import subgraphs
from pulsar.errors import PulsarError, did_you_mean
from pulsar.frontend.check import Sample, compare_models, compare_outputs, random_samples, run
from pulsar.frontend.graph import DEFAULT_DOMAINS
from pulsar.frontend.passes import DEFAULT_PASSES, PASSES
from pulsar.frontend.shapes import infer_shapes, serialized_over

__all__ = ["PassRecord", "PendingCheck", "compare_models", "log_records", "op_histogram", "optimize", "optimize_deferred", "optimized_again"]

log = logging.getLogger(__name__)

MAX_ITERATIONS = 10
ATOL = 1e-6  # about 8 float32 ulps of 1.0: rounding noise, far below what a broken rewrite causes
_PROTO_LIMIT = 2**31 - 1
_SKIP_HINT = (
    "this is a pulsar bug worth reporting; set `onnx_opt.disable_transformation_check: true` to skip "
    "the check (or `onnx_opt.disable_onnx_optimization: true` to skip the passes)"
)


@dataclass
class PassRecord:
    """What one pass did over the whole run (summed over fixed-point iterations)."""

    name: str
    changed_iterations: int = 0
    nodes_before: int = 0
    nodes_after: int = 0
    seconds: float = 0.0
    check_seconds: float = 0.0


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _validate(names: Sequence[str]) -> list[str]:
    for name in names:
        if name not in PASSES:
            raise PulsarError(
                f'onnx_opt: unknown frontend pass "{name}"{did_you_mean(name, PASSES)}; '
                f"known passes: {', '.join(sorted(PASSES))}"
            )
    return list(names)


def _check(
    name: str, model: onnx.ModelProto, samples: list[Sample], ref: list[dict], rtol: float, atol: float
) -> list[dict]:
    """Run the rewritten model, compare with the outputs before the pass; return the new outputs."""
    try:
        new = run(model, samples)
    except Exception as exc:
        raise PulsarError(
            f'transformation check: after frontend pass "{name}" onnxruntime cannot run the model '
            f"({_first_line(exc)}); {_SKIP_HINT}"
        ) from exc
    for row in compare_outputs(ref, new):
        tol = _rtol_for(ref, row["output"], rtol)
        if not (row["rel_diff"] <= tol or row["max_abs_diff"] <= atol):  # `not` also catches NaN
            raise PulsarError(
                f'transformation check failed after frontend pass "{name}": output "{row["output"]}" '
                f"differs from the graph before the pass (max abs diff {row['max_abs_diff']:.3g}, "
                f"relative {row['rel_diff']:.3g} > rtol {tol:g}); {_SKIP_HINT}"
            )
    return new


# Passes that recompute a value more exactly than the graph they replace, so the outputs move by more
# than float32 rounding: a LayerNorm spelled E[x^2] - E[x]^2 cancels catastrophically where the mean is
# large beside the spread (Magika's first one: outputs 4.5e-4 apart); the recogniser's own fit bound.
PASS_RTOL = {"fuse_layernorm_any": 2e-3}

def _rtol_for(ref: list[dict], output: str, rtol: float) -> float:
    """``rtol``, or 4 units in the last place of a float16 output: a folded constant computed in float32
    and rounded once differs from onnxruntime's float16 kernels by an ulp or two (eps 9.8e-4)."""
    value = next((r[output] for r in ref if output in r), None)
    if isinstance(value, np.ndarray) and value.dtype == np.float16:
        return max(rtol, 4 * float(np.finfo(np.float16).eps))
    return rtol


def _mismatch(ref: list[dict], new: list[dict], rtol: float, atol: float) -> dict | None:
    """The first output of ``new`` outside the tolerance against ``ref`` (None when all pass)."""
    for row in compare_outputs(ref, new):
        tol = _rtol_for(ref, row["output"], rtol)
        if not (row["rel_diff"] <= tol or row["max_abs_diff"] <= atol):  # `not` also catches NaN
            return {**row, "tol": tol}
    return None


def _fixed_point(
    model: onnx.ModelProto, names: list[str], check: Callable[[str, onnx.ModelProto], None] | None
) -> tuple[dict[str, PassRecord], list[str]]:
    """Apply ``names`` to ``model`` in place until none changes it; ``check(name, model)`` after
    every change when given. Returns the records and the passes that changed the graph."""
    records = {name: PassRecord(name) for name in names}
    changed_names: list[str] = []
    for iteration in range(MAX_ITERATIONS):
        changed_any = False
        for name in names:
            record = records[name]
            if iteration == 0:
                record.nodes_before = len(model.graph.node)
            start = time.perf_counter()
            try:
                changed = PASSES[name](model)
            except PulsarError:
                raise
            except Exception as exc:
                raise RuntimeError(f'frontend pass "{name}" failed: {exc}') from exc
            record.seconds += time.perf_counter() - start
            if changed:
                record.changed_iterations += 1
                changed_any = True
                changed_names.append(name)
                if check is not None:
                    start = time.perf_counter()
                    check(name, model)
                    record.check_seconds += time.perf_counter() - start
            record.nodes_after = len(model.graph.node)
        if not changed_any:
            break
    else:
        log.warning("frontend passes still changed the graph after %d iterations; stopping", MAX_ITERATIONS)
    return records, changed_names


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """A deep copy in C++ (a serialize / parse round trip costs several times as much with large weights)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


@dataclass
class PendingCheck:
    """The transformation check of one :func:`optimize_deferred` run, waiting for the optimized graph's
    outputs on the check samples. The build's calibration pass runs that graph on those samples anyway
    (its first samples), so handing its outputs to :meth:`settle` spares a session of the model's own
    (0.1-0.15 s with a transformer's weights); without them, :meth:`settle` runs the graph itself."""

    source: onnx.ModelProto  # the input graph, unchanged: the replay starts from it
    model: onnx.ModelProto  # the optimized graph whose outputs are compared
    names: list[str]
    samples: list[Sample]
    ref: list[dict]  # the input graph's outputs on ``samples``
    changed: list[str]
    rtol: float
    atol: float

    def held_bytes(self) -> int:
        """Bytes of the samples and outputs this check holds until it is settled."""
        return sum(int(getattr(v, "nbytes", 0)) for d in [*self.samples, *self.ref] for v in d.values())

    def settle(self, outputs: list[dict] | None = None) -> tuple[onnx.ModelProto, dict[str, PassRecord]] | None:
        """Compare the optimized graph's ``outputs`` on the samples (None: run it here) with the input
        graph's. Passes: None. Differs: the passes are replayed from the input graph with a check after
        every change, so the PulsarError names the pass; when no single pass is out of tolerance the
        replayed graph and records are returned (they equal the optimized ones: passes are deterministic)."""
        tol = max(self.rtol, *(PASS_RTOL.get(name, 0.0) for name in self.changed))
        try:
            bad = _mismatch(self.ref, outputs if outputs is not None else run(self.model, self.samples), tol, self.atol)
        except Exception:  # noqa: BLE001  the replay below names the pass onnxruntime fails after
            bad = {"output": "?"}
        if bad is None:
            return None
        log.info("transformation check: the optimized graph differs (output %s); replaying the passes "
                 "one at a time to find the one that changed it", bad["output"])
        model = _copy(self.source)
        state = {"ref": self.ref}
        rtol, atol, samples = self.rtol, self.atol, self.samples

        def each(name: str, m: onnx.ModelProto) -> None:
            state["ref"] = _check(name, m, samples, state["ref"], max(rtol, PASS_RTOL.get(name, 0.0)), atol)

        records, _ = _fixed_point(model, self.names, each)
        return model, records


def optimize(
    model: onnx.ModelProto,
    passes: list[str] | None = None,
    *,
    check: bool = True,
    samples: list[dict[str, np.ndarray]] | None = None,
    rtol: float = 1e-4,
    atol: float = ATOL,
) -> tuple[onnx.ModelProto, list[PassRecord]]:
    """Apply ``passes`` (default :data:`DEFAULT_PASSES`) until none changes the graph, and check the result.

    An output passes the check when max|a-b| <= rtol * max(max|a|, 1e-6), or when max|a-b| <= atol:
    float32 kernels such as Sigmoid have an absolute error near 1e-7 however small the output, so
    saturated outputs (tiny max|a|) would otherwise fail on rounding alone.
    The check runs once, on the final graph against the input graph (each onnxruntime session costs
    about as much as the passes themselves); only when that fails are the passes replayed from the
    input graph with a check after every change, so the error still names the pass that broke it.
    Works on a copy: the caller's model stays the original for the final ``model_check``.
    """
    model, records, pending = optimize_deferred(model, passes, check=check, samples=samples, rtol=rtol, atol=atol)
    if pending is not None:
        start = time.perf_counter()
        replayed = pending.settle()
        if replayed is not None:
            records = list(replayed[1].values())
            model = optimized_again(replayed, model)
        else:
            changed = set(pending.changed)
            for record in records:  # the one check's time, shared by the passes it covered
                if record.name in changed:
                    record.check_seconds += (time.perf_counter() - start) / len(changed)
    log_records(records)
    return model, records


def log_records(records: list[PassRecord]) -> None:
    """One debug line per pass (the build log's record of what each pass did)."""
    for record in records:
        log.debug(
            "pass %s: changed in %d iteration(s), %d -> %d nodes, %.3fs (+%.3fs check)",
            record.name, record.changed_iterations, record.nodes_before, record.nodes_after,
            record.seconds, record.check_seconds,
        )  # fmt: skip


def optimize_deferred(
    model: onnx.ModelProto,
    passes: list[str] | None = None,
    *,
    check: bool = True,
    samples: list[dict[str, np.ndarray]] | None = None,
    rtol: float = 1e-4,
    atol: float = ATOL,
) -> tuple[onnx.ModelProto, list[PassRecord], PendingCheck | None]:
    """:func:`optimize` without the check of the final graph: that comes back as a :class:`PendingCheck`
    (None when there is nothing to check) for the caller to settle, with outputs it computes anyway or
    without. The input graph's outputs are computed here, before the passes."""
    names = _validate(DEFAULT_PASSES if passes is None else passes)
    small = not serialized_over(model, _PROTO_LIMIT)  # ByteSize() <= limit, without serializing the weights
    source = model
    model = _copy(model) if small else model
    if check and not small:
        log.warning("model is over 2 GB in memory; the transformation check is skipped")
        check = False
    ref: list[dict] = []
    if check:
        samples = list(samples) if samples is not None else random_samples(model)
        try:
            ref = run(model, samples)
        except Exception as exc:
            raise PulsarError(
                f"transformation check: onnxruntime cannot run the input model ({_first_line(exc)}); "
                "fix the model or set `onnx_opt.disable_transformation_check: true`"
            ) from exc

    records, changed = _fixed_point(model, names, None)
    model = _finish(model, small)
    pending = None
    if check and changed:
        assert samples is not None
        pending = PendingCheck(source, model, names, samples, ref, changed, rtol, atol)
    return model, list(records.values()), pending


def optimized_again(settled: tuple[onnx.ModelProto, dict[str, PassRecord]] | None, model: onnx.ModelProto) -> onnx.ModelProto:
    """The graph to go on with after :meth:`PendingCheck.settle`: the replayed one, finished as
    :func:`optimize_deferred` finishes its own, when the settle replayed the passes; else ``model``."""
    if settled is None:
        return model
    return _finish(settled[0], not serialized_over(settled[0], _PROTO_LIMIT))


def _finish(model: onnx.ModelProto, small: bool) -> onnx.ModelProto:
    """Annotations of removed / renamed tensors: re-inferred from scratch, except the outputs of ops in
    other domains (com.microsoft Gelu ...), which onnx's inference cannot type; their passes did."""
    g = model.graph
    custom = {o for n in g.node if n.domain not in DEFAULT_DOMAINS for o in n.output}
    keep = [vi for vi in g.value_info if vi.name in custom]
    del g.value_info[:]
    g.value_info.extend(keep)
    return infer_shapes(model, in_place=small)  # small: our own copy


def _all_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    for node in graph.node:
        yield node
        for sub in subgraphs(node):
            yield from _all_nodes(sub)


def op_histogram(model: onnx.ModelProto) -> dict[str, int]:
    """op_type -> count (subgraphs included), most frequent first, for the before/after report."""
    counts = Counter(node.op_type for node in _all_nodes(model.graph))
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
