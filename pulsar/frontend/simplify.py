"""``onnx_opt.enable_onnxsim``: an external simplifier (onnxsim or onnxslim) before pulsar's passes.

A simplifier is a third-party tool: it can raise on exotic graphs, and nothing guarantees its output
computes the same thing. Neither should end a build that pulsar's own passes can finish, so a failure
or an output that differs from the original (checked in onnxruntime, like every pass) is logged as a
warning naming the model and the build goes on with the unsimplified graph.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import onnx

from pulsar.frontend.check import Sample, compare_outputs, random_samples, run
from pulsar.frontend.graph import graph_input_names
from pulsar.frontend.loader import name_nodes

__all__ = ["DEFAULT_SIMPLIFIER", "SIMPLIFIERS", "SimplifyResult", "simplify"]

log = logging.getLogger(__name__)

DEFAULT_SIMPLIFIER = "onnxsim"
RTOL = 1e-4  # the transformation check's tolerances (pass_manager.optimize)
ATOL = 1e-6


def _onnxsim(model: onnx.ModelProto) -> onnx.ModelProto:
    import onnxsim

    kwargs: dict[str, object] = {"check_n": 0}  # pulsar checks the result itself, on real samples
    if "certify" in inspect.signature(onnxsim.simplify).parameters:
        kwargs["certify"] = False  # onnxsim >= 0.8 may try a Z3 proof when z3 is installed: slow
    simplified: onnx.ModelProto
    simplified, _ok = onnxsim.simplify(model, **kwargs)  # _ok is always True with check_n=0
    # onnxsim >= 0.8 records its settings and every removed node as metadata: provenance of this
    # step only, potentially large, and not something the optimized model should carry on.
    keep = {p.key for p in model.metadata_props}
    props = [p for p in simplified.metadata_props if p.key in keep or not p.key.startswith("onnxsim.")]
    del simplified.metadata_props[:]
    simplified.metadata_props.extend(props)
    return simplified


def _onnxslim(model: onnx.ModelProto) -> onnx.ModelProto:
    import onnxslim

    slimmed: onnx.ModelProto = onnxslim.slim(model)
    return slimmed


SIMPLIFIERS: dict[str, Callable[[onnx.ModelProto], onnx.ModelProto]] = {
    "onnxsim": _onnxsim,
    "onnxslim": _onnxslim,
}


@dataclass
class SimplifyResult:
    """What the simplifier did; ``fallback`` holds the reason when the original graph was kept."""

    model: onnx.ModelProto
    tool: str
    nodes_before: int
    nodes_after: int
    seconds: float
    fallback: str | None = None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _mismatch(
    original: onnx.ModelProto, simplified: onnx.ModelProto, samples: Sequence[Sample]
) -> str | None:
    """Why ``simplified`` does not compute what ``original`` does on ``samples``, or None."""
    # config names and calibration data address the graph inputs and outputs by name
    if graph_input_names(original.graph) != graph_input_names(simplified.graph):
        return "it changed the graph inputs"
    if [o.name for o in original.graph.output] != [o.name for o in simplified.graph.output]:
        return "it changed the graph outputs"
    try:
        ref = run(original, samples)
    except Exception:  # the original cannot run: pass_manager.optimize reports that, naming the fix
        return None
    try:
        new = run(simplified, samples)
    except Exception as exc:
        return f"onnxruntime cannot run its output ({_first_line(exc)})"
    for row in compare_outputs(ref, new):
        if not (row["rel_diff"] <= RTOL or row["max_abs_diff"] <= ATOL):  # `not` also catches NaN
            return (
                f'its output "{row["output"]}" differs from the original (max abs diff '
                f"{row['max_abs_diff']:.3g}, relative {row['rel_diff']:.3g} > {RTOL:g})"
            )
    return None


def simplify(
    model: onnx.ModelProto,
    tool: str = DEFAULT_SIMPLIFIER,
    *,
    model_name: str = "model",
    check: bool = True,
    samples: Sequence[Sample] | None = None,
) -> SimplifyResult:
    """Run ``tool`` on a copy of ``model``; on failure or (with ``check``) a changed result, warn
    and return the original graph. ``samples`` default to seeded random inputs."""
    if tool not in SIMPLIFIERS:
        raise ValueError(f"unknown simplifier {tool!r}; known: {', '.join(SIMPLIFIERS)}")
    before = len(model.graph.node)
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    start = time.perf_counter()
    reason: str | None = None
    simplified: onnx.ModelProto | None = None  # set when the tool returned a model
    try:
        result: object = SIMPLIFIERS[tool](copy)
    except Exception as exc:  # third-party code: any exception is "this tool cannot do this model"
        reason = f"{tool} failed ({type(exc).__name__}: {_first_line(exc)})"
    else:
        if isinstance(result, onnx.ModelProto):
            simplified = result
        else:
            reason = f"{tool} returned no model"
    seconds = time.perf_counter() - start
    if simplified is not None and check:
        samples = list(samples) if samples else random_samples(model)
        why = _mismatch(model, simplified, samples)
        reason = f"{tool}'s result is not equivalent: {why}" if why else None
    if simplified is None or reason is not None:
        log.warning(
            "onnx_opt.enable_onnxsim: %s on %s; continuing with the unsimplified graph (pulsar's own "
            "passes still run)%s",
            reason, model_name, "" if tool == "onnxslim" else "; `onnx_opt.simplifier: onnxslim` may work",
        )  # fmt: skip
        return SimplifyResult(model, tool, before, before, seconds, fallback=reason)
    name_nodes(simplified.graph)
    after = len(simplified.graph.node)
    log.info("%s simplified %s: %d -> %d nodes in %.2f s", tool, model_name, before, after, seconds)
    return SimplifyResult(simplified, tool, before, after, seconds)
