"""The float model on a torch device, node by node, handing chosen tensors to a callback as they appear.

Calibration on ``quant.device cuda:N`` runs its float passes here (onnxruntime has no GPU build on
the machines pulsar targets). It is the fine-tuning executor in float mode over an empty plan (same
op table, same subgraph handling, same onnxruntime fallback for nodes torch cannot run), driven by
its own loop that keeps a tensor only while a later node reads it: memory is bounded by the model's
live tensors, whatever the number of calibrated tensors or samples.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

import onnx
import torch
from onnx import numpy_helper

from pulsar.errors import PulsarError
from pulsar.quant.graph import QuantGraph
from pulsar.quant.plan import QuantPlan
from pulsar.quant.torch_exec.executor import QuantExecutor, _graphs
from pulsar.quant.torch_exec.fallback import OrtNode
from pulsar.quant.torch_exec.ops import TORCH_OPS, Call

Tensor = torch.Tensor
Sink = Callable[[str, Tensor], None]
log = logging.getLogger(__name__)

__all__ = ["FloatPass"]


def _reads(node: onnx.NodeProto) -> list[str]:
    """Every name ``node`` reads: its inputs and, for If / Loop / Scan, what its bodies read (outer scope)."""
    names = [n for n in node.input if n]
    for g in _graphs(node):
        for inner in g.node:
            names += _reads(inner)
    return names


class FloatPass(QuantExecutor):
    """Float execution of an ONNX model in torch, streaming ``wanted`` tensors to a sink per sample."""

    def __init__(self, model: onnx.ModelProto, device: torch.device | str = "cpu") -> None:
        # the executor reads weights through QuantGraph.initializer: hand them over as a dict (one pass
        # over the initializers, not one per weight), then drop the numpy copies it has as tensors now
        weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        qg = QuantGraph(model, QuantPlan(), {}, {}, weights=weights)
        super().__init__(qg, device)
        qg.weights = {}
        del weights
        # nodes with no torch function, run in onnxruntime on the host (an operator plugin's node runs its own forward)
        self.on_ort = {i: f"{n.op_type} ({n.name})" for i, n in enumerate(self.nodes)
                       if isinstance(self.fallback.get(i), OrtNode)}
        last: dict[str, int] = {}
        for idx, node in enumerate(self.nodes):
            for name in _reads(node):
                last[name] = idx
        self._read_later = set(last)
        self.at = 0
        self._free_after: list[list[str]] = [[] for _ in self.nodes]
        for name, idx in last.items():
            self._free_after[idx].append(name)

    def stream(self, feeds: dict[str, Tensor], wanted: Iterable[str], sink: Sink) -> None:
        """Run the model on ``feeds`` (graph input -> tensor on the device); each produced tensor in
        ``wanted`` goes to ``sink(name, tensor)`` once, in graph order, right after its node ran."""
        want = set(wanted)
        env: dict[str, Tensor] = {k: v for k, v in feeds.items() if k in self._read_later}
        for idx, node in enumerate(self.nodes):
            self.at = idx  # the node running, for error messages
            if node.op_type == "Constant":  # its value is fixed, but it is counted once per sample like any tensor
                if node.output[0] in want:
                    sink(node.output[0], self.consts[node.output[0]])
                continue
            ins = [None if not n else env[n] if n in env else self.consts[n] for n in node.input]
            outs = self._node(idx, ins, env)
            del ins
            for name, val in zip(node.output, outs, strict=False):
                if name in want:
                    sink(name, val)
                if name in self._read_later:
                    env[name] = val
            del outs
            for name in self._free_after[idx]:  # no later node reads it: let the device memory go
                env.pop(name, None)

    def _node(self, idx: int, ins: Sequence[Tensor | None], env: dict[str, Tensor]) -> Sequence[Tensor]:
        node = self.nodes[idx]
        if idx in self.fallback:
            return self.fallback[idx](ins)
        call = Call(self.calls[idx], list(ins))
        if self.has_graph[idx]:
            call.run_graph = self._graph_runner(env)
        try:
            return TORCH_OPS[node.op_type](call)
        except torch.cuda.OutOfMemoryError as e:
            raise PulsarError(f"calibration on {self.device}: out of GPU memory at node {node.name!r} "
                              f"({node.op_type}); use quant.device cpu or a smaller input shape") from e
        except (NotImplementedError, RuntimeError) as e:  # a form (or dtype on this device) torch does not run
            log.warning("calibration on %s: %s (%s) runs in onnxruntime on CPU (the torch executor cannot: %s)",
                        self.device, node.op_type, node.name, str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
            self.fallback[idx] = OrtNode(node, self.qg.model.opset_import)
            self.on_ort[idx] = f"{node.op_type} ({node.name})"
            return self.fallback[idx](ins)
