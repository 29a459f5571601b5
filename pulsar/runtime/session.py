"""Run a compiled model: the Python ``Session`` behind ``pulsar run``.

The session executes the subgraphs of a compiled model in order, passing border tensors by name.
How one subgraph body runs is chosen by ``mode`` from a small registry:

- ``Reference``: each body runs in onnxruntime (CPU). QDQ fusion is switched off so NPU bodies
  compute float quantize-dequantize math exactly as written (the float-simulated quantization the
  precision analysis also uses), not onnxruntime's own integer kernels.
- ``NPUBackend`` (bit-exact integer simulation) arrives with the integer NPU backend.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from pulsar.compiler.package import SUBGRAPH_KINDS, CompiledModel, Subgraph, load_compiled
from pulsar.errors import PulsarError, did_you_mean

log = logging.getLogger(__name__)

_CUSTOM_DOMAINS = {k.domain for k in SUBGRAPH_KINDS.values()}


@dataclass(frozen=True)
class TensorInfo:
    """A model input or output. A dimension of -1 is dynamic (any size is accepted)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype


def tensor_info(value: onnx.ValueInfoProto) -> TensorInfo:
    t = value.type.tensor_type
    shape = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim)
    return TensorInfo(value.name, shape, np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type)))


def shape_matches(expected: tuple[int, ...], got: tuple[int, ...]) -> bool:
    return len(expected) == len(got) and all(e < 0 or e == g for e, g in zip(expected, got, strict=True))


def reference_session_options() -> ort.SessionOptions:
    """onnxruntime options for float-simulated quantization (QDQ kept as float math)."""
    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.disable_quant_qdq", "1")
    opts.log_severity_level = 3
    return opts


# A runner executes one subgraph: feeds by name -> outputs by name.
Runner = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]
RUNNER_FACTORIES: dict[str, Callable[[Subgraph, list[onnx.OperatorSetIdProto], int], Runner]] = {}
_NOT_YET = {"NPUBackend": "--mode NPUBackend arrives with the integer NPU backend; use Reference"}


def register_mode(name: str):
    def deco(factory):
        RUNNER_FACTORIES[name] = factory
        return factory

    return deco


@register_mode("Reference")
def _reference_runner(sg: Subgraph, opsets: list[onnx.OperatorSetIdProto], ir_version: int) -> Runner:
    model = helper.make_model(sg.graph, opset_imports=opsets)
    model.ir_version = ir_version
    try:
        sess = ort.InferenceSession(
            model.SerializeToString(), reference_session_options(), providers=["CPUExecutionProvider"]
        )
    except Exception as exc:  # onnxruntime raises its own exception types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PulsarError(
            f"subgraph {sg.name!r} cannot be loaded by onnxruntime ({first}); rebuild the model"
        ) from None
    names = [o.name for o in sess.get_outputs()]

    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(names, sess.run(names, feeds), strict=True))

    return run


class Session:
    """Load a compiled model once, run it many times."""

    def __init__(self, model: str | Path | CompiledModel, *, mode: str = "Reference") -> None:
        if mode not in RUNNER_FACTORIES:
            if mode in _NOT_YET:
                raise PulsarError(_NOT_YET[mode])
            known = sorted(RUNNER_FACTORIES)
            raise PulsarError(f"unknown --mode {mode!r}{did_you_mean(mode, known)}; choose one of {known}")
        self.compiled = model if isinstance(model, CompiledModel) else load_compiled(model)
        self.mode = mode
        graph = self.compiled.model.graph
        self.inputs: list[TensorInfo] = [tensor_info(v) for v in graph.input]
        self.outputs: list[TensorInfo] = [tensor_info(v) for v in graph.output]
        self.metadata: dict = self.compiled.metadata
        self._ranked = {v.name for v in graph.input if v.type.tensor_type.HasField("shape")}
        opsets = [op for op in self.compiled.model.opset_import if op.domain not in _CUSTOM_DOMAINS]
        factory = RUNNER_FACTORIES[mode]
        ir_version = self.compiled.model.ir_version
        self._runners = [factory(sg, opsets, ir_version) for sg in self.compiled.subgraphs]
        self._io = [
            ([i.name for i in sg.graph.input], [o.name for o in sg.graph.output])
            for sg in self.compiled.subgraphs
        ]
        log.debug("session: %d subgraphs, mode %s", len(self._runners), mode)

    def _check_feeds(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        expected = {t.name: t for t in self.inputs}
        for name in feeds:
            if name not in expected:
                raise PulsarError(
                    f'unknown input "{name}"{did_you_mean(name, expected)}; model inputs: {sorted(expected)}'
                )
        checked = {}
        for info in self.inputs:
            if info.name not in feeds:
                raise PulsarError(f'missing input "{info.name}" (shape {info.shape}, dtype {info.dtype})')
            value = np.asarray(feeds[info.name])
            if value.dtype != info.dtype:
                raise PulsarError(
                    f'input "{info.name}": expected dtype {info.dtype}, got {value.dtype}; cast it'
                )
            if info.name in self._ranked and not shape_matches(info.shape, value.shape):
                raise PulsarError(f'input "{info.name}": expected shape {info.shape}, got {value.shape}')
            checked[info.name] = value
        return checked

    def run(
        self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None
    ) -> dict[str, np.ndarray]:
        """Run the model; ``output_names`` may also name tensors between subgraphs."""
        env = self._check_feeds(feeds)
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
        for i in reversed(range(len(self._runners))):
            ins, outs = self._io[i]
            if needed & set(outs):
                todo.append(i)
                needed |= set(ins)
        for i in reversed(todo):
            ins, _ = self._io[i]
            env.update(self._runners[i]({n: env[n] for n in ins}))
        return {name: env[name] for name in wanted}
