"""Run a compiled model: the Python ``Session`` behind ``pulsar run``.

The session executes the subgraphs of a compiled model in order, passing border tensors by name.
How one subgraph body runs is chosen by ``mode`` from a small registry:

- ``NPUBackend`` (default): NPU subgraphs run their integer program in the bit-exact simulator
  (:class:`pulsar.runtime.npu_sim.NpuProgram`, the arithmetic of docs/integer_semantics.md); CPU
  subgraphs run in onnxruntime.
- ``Reference``: NPU subgraphs run their ``reference_body`` (the float QDQ fragment) in onnxruntime
  with QDQ fusion switched off, so quantize-dequantize is float math exactly as written (what the
  precision analysis uses), not onnxruntime's own integer kernels; CPU subgraphs as above.

Both modes exchange the same integer tensors at NPU borders, so a CPU subgraph never knows which
mode produced its input. A model with variants (container format 3) runs one shape group (``group``)
and, when multi-batch, any number of samples: each subgraph runs them as its compiled batches
(:mod:`pulsar.runtime.batching`), its runners prepared per variant on first use. Several samples (``run_many``, ``run_batches``) run in parallel threads,
one core each (:mod:`pulsar.runtime.parallel`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from pulsar.core.container import SUBGRAPH_KINDS, CompiledModel, Subgraph, load_compiled
from pulsar.core.custom_ops import check_known_ops, ensure_plugins
from pulsar.core.int_ops import INT_DOMAIN
from pulsar.core.ort_errors import ort_guard
from pulsar.core.ort_options import reference_session_options
from pulsar.core.plugin_session import inference_session
from pulsar.core.tensors import TensorInfo, shape_matches
from pulsar.core.variants import variants_of
from pulsar.errors import PulsarError, did_you_mean
from pulsar.runtime.batching import GroupView, describe_plan, group_text, run_split, split_feeds
from pulsar.runtime.parallel import map_samples

log = logging.getLogger(__name__)

_CUSTOM_DOMAINS = {k.domain for k in SUBGRAPH_KINDS.values()} | {INT_DOMAIN}


def check_mode(mode: str) -> None:
    if mode not in RUNNER_FACTORIES:
        known = sorted(RUNNER_FACTORIES)
        raise PulsarError(f"unknown --mode {mode!r}{did_you_mean(mode, known)}; choose one of {known}")


def batched_inputs(inputs: list[TensorInfo], batch_size: int) -> list[TensorInfo]:
    """``inputs`` for ``batch_size`` samples stacked along axis 0 (what ``Session.run_batches`` takes)."""
    if batch_size < 1:
        raise PulsarError(f"--batch_size must be at least 1, got {batch_size}")
    if batch_size == 1:  # as compiled: a dynamic batch dimension is fine too
        return list(inputs)
    out = []
    for info in inputs:
        if not info.shape or info.shape[0] < 1:
            raise PulsarError(f'input "{info.name}" has no static batch dimension (shape {info.shape}); '
                              "--batch_size needs one")
        out.append(TensorInfo(info.name, (info.shape[0] * batch_size, *info.shape[1:]), info.dtype))
    return out


# A runner executes one subgraph: feeds by name -> outputs by name (every tensor with ``keep``).
Runner = Callable[[dict[str, np.ndarray], bool], dict[str, np.ndarray]]
RUNNER_FACTORIES: dict[str, Callable[[Subgraph, list[onnx.OperatorSetIdProto], int], Runner]] = {}
DEFAULT_MODE = "NPUBackend"


def register_mode(name: str):
    def deco(factory):
        RUNNER_FACTORIES[name] = factory
        return factory

    return deco


def _with_all_outputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every typed intermediate tensor added as a graph output (per-layer dumps)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    g = inferred.graph
    have = {o.name for o in g.output} | {i.name for i in g.input}
    typed = {v.name: v for v in g.value_info if v.type.tensor_type.elem_type != TensorProto.BFLOAT16}
    extra = [typed[o] for n in g.node for o in n.output if o in typed and o not in have]
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.graph.output.extend(extra)
    return out


def _widen_bfloat16(graph: onnx.GraphProto) -> tuple[onnx.GraphProto, set[str], set[str]]:
    """onnxruntime's Python API has no numpy type for bfloat16: a copy of ``graph`` whose bfloat16 inputs
    and outputs are float32 (a Cast inside converts, exactly), and the names of those inputs / outputs."""
    bf16 = TensorProto.BFLOAT16
    ins = {v.name for v in graph.input if v.type.tensor_type.elem_type == bf16}
    outs = {v.name for v in graph.output if v.type.tensor_type.elem_type == bf16}
    if not ins and not outs:
        return graph, ins, outs
    g = onnx.GraphProto()
    g.CopyFrom(graph)
    casts = [helper.make_node("Cast", [f"{n}/float32"], [n], to=bf16) for n in ins]
    for v in [*g.input, *g.output]:
        if v.name in ins | outs:
            v.name, v.type.tensor_type.elem_type = f"{v.name}/float32", TensorProto.FLOAT
    nodes = casts + list(g.node) + [helper.make_node("Cast", [n], [f"{n}/float32"], to=TensorProto.FLOAT)
                                    for n in outs]
    del g.node[:]
    g.node.extend(nodes)
    return g, ins, outs


def ort_runner(graph: onnx.GraphProto, name: str, opsets: list[onnx.OperatorSetIdProto], ir_version: int) -> Runner:
    """Run ``graph`` in onnxruntime with QDQ kept as float math (lazily adds all outputs for ``keep``)."""
    graph, bf16_in, bf16_out = _widen_bfloat16(graph)
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = ir_version
    sessions: dict[bool, tuple[ort.InferenceSession, list[str]]] = {}
    lock = threading.Lock()  # samples may run in parallel threads (Session.run_many)

    def session(keep: bool) -> tuple[ort.InferenceSession, list[str]]:
        with lock:
            return sessions[keep] if keep in sessions else create(keep)

    def create(keep: bool) -> tuple[ort.InferenceSession, list[str]]:
        m = _with_all_outputs(model) if keep else model
        try:
            # the large weights reach onnxruntime as arrays, not serialized and parsed again
            sess = inference_session(m, reference_session_options(), providers=["CPUExecutionProvider"],
                                     lift_weights=True)
        except Exception as exc:  # onnxruntime raises its own exception types
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise PulsarError(
                f"subgraph {name!r} cannot be loaded by onnxruntime ({first}); rebuild the model"
            ) from None
        sessions[keep] = (sess, [o.name for o in sess.get_outputs()])
        return sessions[keep]

    session(False)

    def run(feeds: dict[str, np.ndarray], keep: bool = False) -> dict[str, np.ndarray]:
        sess, names = session(keep)
        with ort_guard(f"running subgraph {name!r}", "check the inputs this subgraph receives (their values, "
                       "not only their shapes: an index or a shape read from data must be valid)"):
            if bf16_in:
                feeds = {(f"{k}/float32" if k in bf16_in else k): (np.asarray(v, np.float32) if k in bf16_in else v)
                         for k, v in feeds.items()}
            out = dict(zip(names, sess.run(names, feeds), strict=True))
        for k in bf16_out:
            out[k] = out.pop(f"{k}/float32").astype(ml_dtypes.bfloat16)
        return out

    return run


@register_mode("Reference")
def _reference_runner(sg: Subgraph, opsets: list[onnx.OperatorSetIdProto], ir_version: int) -> Runner:
    graph = sg.reference if sg.kind == "npu" and sg.reference is not None else sg.graph
    return ort_runner(graph, sg.name, opsets, ir_version)


@register_mode("NPUBackend")
def _npu_backend_runner(sg: Subgraph, opsets: list[onnx.OperatorSetIdProto], ir_version: int) -> Runner:
    if sg.kind != "npu":
        return ort_runner(sg.graph, sg.name, opsets, ir_version)
    from pulsar.runtime.npu_sim import NpuProgram

    program = NpuProgram(sg.graph)

    def run(feeds: dict[str, np.ndarray], keep: bool = False) -> dict[str, np.ndarray]:
        return program.run(feeds, keep=keep)

    run.program = program  # type: ignore[attr-defined]  # per-op isolated runs (compiler CheckPerLayer)
    return run


def run_steps_isolated(program, given: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every op of an NPU program fed ``given``'s value of each input it reads (its own results for
    tensors ``given`` lacks): per-op differences without the cascade of earlier ones."""
    env: dict[str, np.ndarray] = {}
    for step in program.steps:
        args = [None if not n else given[n] if n in given else env[n] if n in env else program.consts[n]
                for n in step.inputs]
        for name, value in zip(step.outputs, step.kernel(args), strict=False):
            if name:
                env[name] = value
    return env


class Session:
    """Load a compiled model once, run it many times.

    ``group`` picks the shape group (``pulsar run --group_index``). In a multi-batch model, ``inputs``
    describe one sample (axis 0 is 1) and every call takes any number of samples on axis 0: each
    subgraph runs them as its compiled batches, largest first (:mod:`pulsar.runtime.batching`)."""

    def __init__(self, model: str | Path | CompiledModel, *, mode: str = DEFAULT_MODE, group: int = 0,
                 workers: int | None = None) -> None:
        check_mode(mode)
        self.compiled = model if isinstance(model, CompiledModel) else load_compiled(model)
        self.mode = mode
        self.view = GroupView.of(self.compiled, group)
        self.group = group
        self.inputs: list[TensorInfo] = self.view.inputs
        self.outputs: list[TensorInfo] = self.view.outputs
        self.metadata: dict = self.compiled.metadata
        self.workers = workers
        where = f"compiled model {model}" if not isinstance(model, CompiledModel) else "compiled model"
        ensure_plugins(self.metadata.get("op_plugins") or [], where)  # before its CPU runners are prepared
        for sg in self.compiled.subgraphs:
            if sg.kind == "cpu":
                check_known_ops(sg.graph, where, "give it with --op_plugin FILE")
        graph = self.compiled.model.graph
        self._ranked = {v.name for v in graph.input if v.type.tensor_type.HasField("shape")}
        self._opsets = [op for op in self.compiled.model.opset_import if op.domain not in _CUSTOM_DOMAINS]
        self._factory = RUNNER_FACTORIES[mode]
        self._runners: dict[tuple[int, int], Runner] = {}
        self._lock = threading.Lock()
        self._io = [
            ([i.name for i in sg.graph.input], [o.name for o in sg.graph.output])
            for sg in self.compiled.subgraphs
        ]
        if not self.view.multi_batch:  # prepared now, as before variants: load errors surface here
            for i in range(len(self._io)):
                self._runner(i, 1)
        log.debug("session: %d subgraphs, mode %s, group %d", len(self._io), mode, group)

    @property
    def batch_sizes(self) -> list[int]:
        """The compiled batch sizes of this group ([1] for a model without multi-batch)."""
        return self.view.batch_sizes if self.view.multi_batch else [1]

    def _runner(self, index: int, batch: int) -> Runner:
        variant = self.view.variant(index, batch)
        key = (index, variant)
        with self._lock:
            if key not in self._runners:
                sg = self.compiled.subgraphs[index]
                self._runners[key] = self._factory(sg.at(variant), self._opsets, self.compiled.model.ir_version)
            return self._runners[key]

    def _run_subgraph(self, index: int, feeds: dict[str, np.ndarray], n: int, keep: bool) -> dict[str, np.ndarray]:
        """Subgraph ``index`` on ``n`` samples; ``keep`` returns its inner tensors when it runs as one body."""
        name = self.compiled.subgraphs[index].name
        plan = self.view.plan(index, n, name)
        if len(plan) == 1:
            return self._runner(index, plan[0])(feeds, keep)
        outs = set(self._io[index][1])
        return run_split(lambda b, chunk: {k: v for k, v in self._runner(index, b)(chunk, False).items() if k in outs},
                         feeds, plan, self.view.batch_axes, n,
                         lambda fn, items: map_samples(fn, items, self.workers))

    def split_outputs(self, n: int) -> set[str]:
        """Outputs of the subgraphs that run ``n`` samples as several compiled batches (their inner
        tensors are not returned by :meth:`run_all`, and :meth:`run_isolated` runs them whole)."""
        return {name for i, (_, outs) in enumerate(self._io)
                if len(self.view.plan(i, n, self.compiled.subgraphs[i].name)) > 1 for name in outs}

    def batch_plan(self, n: int) -> str:
        """How ``n`` samples run, per NPU subgraph (``npu_0: 4 + 4 + 1``)."""
        sgs = self.compiled.subgraphs
        return describe_plan(self.view, [sg.name for sg in sgs], [sg.kind for sg in sgs], n)

    def _check_feeds(self, feeds: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int]:
        """The feeds checked against the inputs, and the number of samples they hold."""
        expected = {t.name: t for t in self.inputs}
        for name in feeds:
            if name not in expected:
                raise PulsarError(
                    f'unknown input "{name}"{did_you_mean(name, expected)}; model inputs: {sorted(expected)}'
                )
        checked, counts = {}, set()
        for info in self.inputs:
            if info.name not in feeds:
                raise PulsarError(f'missing input "{info.name}" (shape {info.shape}, dtype {info.dtype})')
            value = np.asarray(feeds[info.name])
            if value.dtype != info.dtype:
                raise PulsarError(
                    f'input "{info.name}": expected dtype {info.dtype}, got {value.dtype}; cast it'
                )
            want = info.shape
            if self.view.multi_batch and value.ndim == len(want) and value.ndim and value.shape[0] >= 1:
                want = (value.shape[0], *want[1:])
                counts.add(value.shape[0])
            if info.name in self._ranked and not shape_matches(want, value.shape):
                raise PulsarError(f'input "{info.name}": expected shape {self._shape_text(info)}, got {value.shape}'
                                  + self._group_hint())
            checked[info.name] = value
        if len(counts) > 1:
            raise PulsarError(f"the inputs hold different numbers of samples on axis 0 ({sorted(counts)}); "
                              "give every input the same batch")
        return checked, counts.pop() if counts else 1

    def _shape_text(self, info: TensorInfo) -> str:
        return f"[N, {', '.join(map(str, info.shape[1:]))}] (N samples)" if self.view.multi_batch else str(info.shape)

    def _group_hint(self) -> str:
        return f" (group {self.group}; the model's groups: {group_text(self.compiled)})" \
            if len(self.view_groups()) > 1 else ""

    def view_groups(self) -> list[int]:
        return sorted({v.group for v in variants_of(self.compiled.metadata)})

    def batched_inputs(self, batch_size: int) -> list[TensorInfo]:
        """Input infos for ``batch_size`` samples stacked along axis 0 (what ``run_batches`` takes)."""
        return batched_inputs(self.inputs, batch_size)

    def run_batches(self, feeds: dict[str, np.ndarray], batch_size: int,
                    workers: int | None = None) -> dict[str, np.ndarray]:
        """Run ``batch_size`` stacked samples: in a multi-batch model as its compiled batches (largest
        first), else one compiled run per sample, ``workers`` of them in parallel (see
        :meth:`run_many`); outputs stacked on axis 0."""
        if batch_size == 1:
            return self.run(feeds)
        self.batched_inputs(batch_size)
        if self.view.multi_batch:
            for info in self.inputs:
                value = np.asarray(feeds[info.name]) if info.name in feeds else None
                if value is not None and (value.ndim == 0 or value.shape[0] != batch_size):
                    raise PulsarError(f'input "{info.name}": expected {batch_size} samples on axis 0 '
                                      f"(--batch_size {batch_size}), got shape {value.shape}")
            before, self.workers = self.workers, workers if workers is not None else self.workers
            try:
                return self.run(feeds)
            finally:
                self.workers = before
        parts: list[dict[str, np.ndarray]] = []
        for k in range(batch_size):
            part = {}
            for info in self.inputs:
                value = np.asarray(feeds[info.name])
                b = info.shape[0]
                if value.shape[0] != b * batch_size:
                    raise PulsarError(f'input "{info.name}": expected {batch_size} x {b} samples on axis 0 '
                                      f"(--batch_size {batch_size}), got shape {value.shape}")
                part[info.name] = value[k * b:(k + 1) * b]
            parts.append(part)
        results = self.run_many(parts, workers=workers)
        return {name: np.concatenate([p[name] for p in results], axis=0) for name in results[0]}

    def warm_up(self, feeds: dict[str, np.ndarray], batch_size: int = 1) -> None:
        """One run of the first compiled batch of ``feeds`` (``batch_size`` stacked samples, as
        :meth:`run_batches` takes them), outputs dropped, and every runner the full call uses prepared:
        the first run pays once for lazy setup (torch and onnxruntime first calls, allocations), so
        runs timed after this one measure the model."""
        if not self.view.multi_batch:
            # one compiled run: batch_size > 1 needs a static batch dimension (see batched_inputs)
            self.run(feeds if batch_size == 1 else {i.name: np.asarray(feeds[i.name])[:i.shape[0]]
                                                    for i in self.inputs})
            return
        names = [sg.name for sg in self.compiled.subgraphs]
        k = next((b for b in [*self.batch_sizes, batch_size] if b <= batch_size and self._plannable(b)), batch_size)
        part = feeds if k == batch_size else \
            split_feeds(feeds, [k, batch_size - k], self.view.batch_axes, batch_size)[0]
        self.run(part)
        for i, name in enumerate(names):
            for b in self.view.plan(i, batch_size, name):
                self._runner(i, b)

    def _plannable(self, n: int) -> bool:
        """Every subgraph can run ``n`` samples as its compiled batches."""
        try:
            for i, sg in enumerate(self.compiled.subgraphs):
                self.view.plan(i, n, sg.name)
        except PulsarError:
            return False
        return True

    def run_many(self, samples: Sequence[dict[str, np.ndarray]], output_names: list[str] | None = None,
                 workers: int | None = None) -> list[dict[str, np.ndarray]]:
        """``[run(s) for s in samples]`` with up to ``workers`` samples at a time, one core each
        (default: one worker per core; see :mod:`pulsar.runtime.parallel`). Same results, same order."""
        return map_samples(lambda feeds: self.run(feeds, output_names), list(samples), workers)

    def run_all(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every tensor the model computes (inputs, per-layer tensors of every subgraph, outputs):
        the integer tensors of NPU subgraphs, the float ones of CPU subgraphs. (A subgraph that runs as
        several compiled batches gives its outputs only.)"""
        env, n = self._check_feeds(feeds)
        for i, (ins, _) in enumerate(self._io):
            env.update(self._run_subgraph(i, {k: env[k] for k in ins}, n, True))
        return env

    def run_isolated(self, feeds: dict[str, np.ndarray], given: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every tensor, each subgraph (and each op of an NPU program) fed the values ``given`` holds
        for its inputs, e.g. another mode's ``run_all``: where two runs first disagree, per layer."""
        env, n = self._check_feeds(feeds)
        for i, (ins, _) in enumerate(self._io):
            local = {k: given.get(k, env.get(k)) for k in ins}
            plan = self.view.plan(i, n, self.compiled.subgraphs[i].name)
            runner = self._runner(i, plan[0])
            program = getattr(runner, "program", None)
            if program is not None and len(plan) == 1:
                env.update(run_steps_isolated(program, {**given, **local}))
            else:
                env.update(self._run_subgraph(i, local, n, True))
        return env

    def run_subgraphs(self, feeds: dict[str, np.ndarray], given: dict[str, np.ndarray],
                      indices: Sequence[int]) -> dict[str, np.ndarray]:
        """The outputs of subgraphs ``indices``, each fed ``given``'s values of its inputs (another mode's
        ``run_all``): a part of the model (a compiler.sub_configs range) checked on its outputs alone;
        ``feeds`` (the model's inputs) give the number of samples."""
        _, n = self._check_feeds(feeds)
        out: dict[str, np.ndarray] = {}
        for i in indices:
            ins, _ = self._io[i]
            out.update(self._run_subgraph(i, {k: given[k] for k in ins}, n, False))
        return out

    def run(
        self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None
    ) -> dict[str, np.ndarray]:
        """Run the model; ``output_names`` may also name tensors between subgraphs."""
        env, n = self._check_feeds(feeds)
        wanted = list(output_names) if output_names is not None else [o.name for o in self.outputs]
        known = {o.name for o in self.outputs} | {n for _, outs in self._io for n in outs} | set(env)
        for name in wanted:
            if name not in known:
                raise PulsarError(
                    f'unknown output "{name}"{did_you_mean(name, known)}; model outputs: '
                    f"{[o.name for o in self.outputs]}"
                )
        # Only the subgraphs the wanted tensors depend on run.
        needed, todo = set(wanted), []
        for i in reversed(range(len(self._io))):
            ins, outs = self._io[i]
            if needed & set(outs):
                todo.append(i)
                needed |= set(ins)
        for i in reversed(todo):
            ins, _ = self._io[i]
            env.update(self._run_subgraph(i, {k: env[k] for k in ins}, n, False))
        return {name: env[name] for name in wanted}
