"""Bit-exact simulator of the virtual NPU: runs an integer body graph with the registered kernels.

An :class:`NpuProgram` is built once per body: initializers (and the enclosing graph's constants the
body refers to) are converted once, and every node's kernel is prepared once with its attributes and
constant inputs. ``run`` then only moves arrays between kernels, checks each result against the
body's ``value_info`` (dtype and static shape) and frees tensors after their last reader. Without
per-layer dumps, a table lookup whose result only a Requantize reads runs fused with it as one
gather (:class:`ChainTable`: the same bits, a fraction of the passes over the tensor).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from pulsar.core.tensors import initializer_array
from pulsar.errors import PulsarError, did_you_mean
from pulsar.runtime.kernels import DOMAINS, INT_DOMAIN, KERNELS, Kernel, supported_ops
from pulsar.runtime.kernels.lut import ChainTable

log = logging.getLogger(__name__)

__all__ = ["NpuProgram", "body_ops", "supported_ops", "unsupported_ops"]


def body_ops(graph: onnx.GraphProto) -> set[str]:
    """Op types used by a body graph."""
    return {node.op_type for node in graph.node}


def unsupported_ops(graph: onnx.GraphProto) -> set[str]:
    """Op types of ``graph`` the simulator has no kernel for."""
    return body_ops(graph) - supported_ops()


@dataclass(frozen=True)
class _Expect:
    dtype: np.dtype | None
    shape: tuple[int | None, ...] | None

    @classmethod
    def of(cls, value: onnx.ValueInfoProto) -> _Expect:
        t = value.type.tensor_type
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type)) if t.elem_type else None
        shape = None
        if t.HasField("shape"):
            shape = tuple(d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim)
        return cls(dtype, shape)

    def problem(self, value: np.ndarray) -> str | None:
        if self.dtype is not None and value.dtype != self.dtype:
            return f"dtype {value.dtype}, expected {self.dtype}"
        if self.shape is not None and value.shape != self.shape and (len(self.shape) != value.ndim or any(
                e is not None and e != g for e, g in zip(self.shape, value.shape, strict=True))):
            return f"shape {value.shape}, expected {tuple(-1 if e is None else e for e in self.shape)}"
        return None


@dataclass
class _Step:
    label: str
    op: str
    inputs: list[str]
    outputs: list[str]
    kernel: Kernel
    frees: list[str]
    n_named: int = 0  # outputs the node names (an empty name is an absent optional output)

    def __post_init__(self) -> None:
        self.n_named = sum(1 for n in self.outputs if n)


def _domain(domain: str) -> str:
    return "" if domain in ("", "ai.onnx") else domain


class NpuProgram:
    """An NPU body prepared for repeated bit-exact execution.

    ``constants`` supplies outer-scope initializers (compiled models store weights once at top level
    and bodies refer to them by name)."""

    def __init__(self, graph: onnx.GraphProto, constants: Mapping[str, np.ndarray] | None = None) -> None:
        self.name = graph.name or "body"
        self.consts: dict[str, np.ndarray] = dict(constants or {})
        self.consts.update({init.name: initializer_array(init) for init in graph.initializer})
        expect = {v.name: _Expect.of(v) for v in (*graph.input, *graph.value_info, *graph.output)}
        self.inputs = [v.name for v in graph.input if v.name not in self.consts]
        self.outputs = [v.name for v in graph.output]
        self._expect = expect
        self.steps: list[_Step] = []
        for index, node in enumerate(graph.node):
            self._prepare(node, index)
        self._check_wiring()
        self._plan_frees(self.steps)
        # without per-layer dumps, table lookups and the requantization after them run as one gather
        self._fast = _fuse_tables(self.steps, self.consts, set(self.outputs))
        self._plan_frees(self._fast)
        log.debug("npu program %s: %d steps, %d constants", self.name, len(self.steps), len(self.consts))

    def _where(self, label: str, op: str) -> str:
        return f"NPU body {self.name!r}, node {label!r} ({op})"

    def _prepare(self, node: onnx.NodeProto, index: int) -> None:
        op, label = node.op_type, node.name or f"{node.op_type}_{index}"
        if op not in KERNELS:
            raise PulsarError(
                f"{self._where(label, op)}: op {op!r} (domain {node.domain or 'ai.onnx'!r}) is not supported by the "
                f"NPU simulator{did_you_mean(op, KERNELS)}; supported: {sorted(KERNELS)}"
            )
        if _domain(node.domain) != DOMAINS[op]:
            want = DOMAINS[op] or "ai.onnx"
            raise PulsarError(f"{self._where(label, op)}: domain {node.domain or 'ai.onnx'!r}, expected {want!r}"
                              + (" (integer ops live in the pulsar.int domain)" if DOMAINS[op] == INT_DOMAIN else ""))
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if op == "Split" and "num_outputs" not in attrs:
            attrs["num_outputs"] = len(node.output)
        consts = [self.consts.get(name) if name else None for name in node.input]
        try:
            kernel = KERNELS[op](attrs, consts)
            if op == "Constant":  # folded now: readers see it as a constant input
                self.consts[node.output[0]] = kernel([])[0]
                return
        except PulsarError as exc:
            raise PulsarError(f"{self._where(label, op)}: {exc}") from None
        self.steps.append(_Step(label, op, list(node.input), list(node.output), kernel, []))

    def _check_wiring(self) -> None:
        """Every input is a graph input, a constant or an earlier output (bodies are topologically sorted)."""
        known = set(self.inputs) | set(self.consts)
        for step in self.steps:
            for name in step.inputs:
                if name and name not in known:
                    raise PulsarError(f"{self._where(step.label, step.op)}: input {name!r} is not produced by an "
                                      "earlier node, a graph input or a constant (initializer of the body or "
                                      "of the enclosing model)")
            known.update(n for n in step.outputs if n)
        missing = [n for n in self.outputs if n not in known]
        if missing:
            raise PulsarError(f"NPU body {self.name!r}: graph outputs {missing} are never produced")

    def _plan_frees(self, steps: list[_Step]) -> None:
        """After each step, drop the tensors no later step reads (graph outputs are kept)."""
        last: dict[str, int] = {}
        for i, step in enumerate(steps):
            for name in step.inputs:
                if name and name not in self.consts:
                    last[name] = i
        keep = set(self.outputs)
        for name, i in last.items():
            if name not in keep:
                steps[i].frees.append(name)

    def _feeds(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        env: dict[str, np.ndarray] = {}
        for name in self.inputs:
            if name not in feeds:
                raise PulsarError(f"NPU body {self.name!r}: missing input {name!r}; inputs: {self.inputs}")
            value = np.asarray(feeds[name])
            problem = self._expect[name].problem(value) if name in self._expect else None
            if problem:
                raise PulsarError(f"NPU body {self.name!r}: input {name!r} has {problem}")
            env[name] = value
        return env

    def run(self, feeds: Mapping[str, np.ndarray], keep: bool = False) -> dict[str, np.ndarray]:
        """Outputs by name; ``keep=True`` also returns every intermediate tensor (per-layer dumps).

        Outputs are C-contiguous arrays; intermediates may have another memory layout (2-D
        convolutions keep theirs channels-last), which changes no value."""
        env = self._feeds(feeds)
        consts = self.consts
        expect = self._expect
        kept: dict[str, np.ndarray] = {}
        for step in self.steps if keep else self._fast:
            args = [(env[n] if n in env else consts[n]) if n else None for n in step.inputs]
            try:
                results = step.kernel(args)
            except PulsarError as exc:
                raise PulsarError(f"{self._where(step.label, step.op)}: {exc}") from None
            except (ValueError, IndexError, TypeError, RuntimeError) as exc:
                shapes = [None if a is None else (a.dtype.name, a.shape) for a in args]
                raise PulsarError(f"{self._where(step.label, step.op)} failed on inputs {shapes}: {exc}") from exc
            if len(results) < step.n_named:
                raise PulsarError(f"{self._where(step.label, step.op)}: the kernel gives {len(results)} outputs, "
                                  f"the node names {step.n_named}")
            for name, value in zip(step.outputs, results, strict=False):
                if not name:
                    continue
                if not isinstance(value, np.ndarray):  # a numpy scalar: the rank-0 result stays an array
                    value = np.asarray(value)
                check = expect.get(name)
                problem = check.problem(value) if check is not None else None
                if problem:
                    raise PulsarError(f"{self._where(step.label, step.op)}: output {name!r} has {problem} "
                                      "(value_info disagrees with the kernel)")
                env[name] = value
                if keep:
                    kept[name] = value
            if not keep:
                for name in step.frees:
                    env.pop(name, None)
        outputs = {n: _c_order(env[n] if n in env else consts[n]) for n in self.outputs}
        return {**kept, **outputs} if keep else outputs


def _fuse_tables(steps: list[_Step], consts: Mapping[str, np.ndarray], outputs: set[str]) -> list[_Step]:
    """``steps`` with each QLut (constant table) whose result only a Requantize reads replaced by one
    :class:`ChainTable` step in the QLut's place (its input exists there; its output is read after
    the Requantize's place only). Copies of the steps: their free lists are planned afresh."""
    readers: dict[str, list[int]] = {}
    for i, step in enumerate(steps):
        for name in step.inputs:
            if name:
                readers.setdefault(name, []).append(i)
    fused: dict[int, _Step] = {}
    dropped: set[int] = set()
    for i, step in enumerate(steps):
        if step.op != "QLut" or len(step.inputs) != 2 or step.inputs[1] not in consts or step.n_named != 1:
            continue
        mid = step.outputs[0]
        users = readers.get(mid, [])
        if mid in outputs or len(users) != 1 or users[0] in dropped:
            continue
        then = steps[users[0]]
        if then.op != "Requantize" or [n for n in then.inputs if n] != [mid] or then.inputs[0] != mid:
            continue
        table = consts[step.inputs[1]]

        def first(inputs: list[np.ndarray | None], kernel: Kernel = step.kernel,
                  table: np.ndarray = table) -> list[np.ndarray]:
            return kernel([inputs[0], table])

        fused[i] = _Step(f"{step.label}+{then.label}", "QLut+Requantize", step.inputs[:1], list(then.outputs),
                         ChainTable([first, then.kernel]), [])
        dropped.add(users[0])
    return [fused.get(i) or _Step(s.label, s.op, s.inputs, s.outputs, s.kernel, [])
            for i, s in enumerate(steps) if i not in dropped]


def _c_order(value: np.ndarray) -> np.ndarray:
    """``value`` itself when C-contiguous, else a C-ordered copy (0-d arrays stay 0-d)."""
    return value if value.flags.c_contiguous else value.copy(order="C")
