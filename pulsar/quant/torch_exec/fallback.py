"""Nodes with no torch function run in onnxruntime, one node per session, without a gradient.

Fine-tuning needs the whole graph to run (float targets, the next block's inputs) but only the
blocks it trains need gradients. A node that torch cannot run (a custom-domain op, an op of a later
opset) still runs, exactly as onnxruntime runs it in the build's checks; a block whose weights reach
its outputs only through such a node stays calibrated (:mod:`pulsar.quant.finetune.gradient`). An operator
plugin's op runs its ``torch_forward`` (gradients included) or its numpy forward (:class:`PluginNode`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import torch
from onnx import helper

from pulsar.core.custom_ops import CustomOp, call, node_op, run_numpy
from pulsar.quant.torch_exec.ops.registry import Tensor


def _elem_type(t: Tensor) -> int:
    return int(helper.np_dtype_to_tensor_dtype(np.dtype(str(t.dtype).removeprefix("torch."))))


class OrtNode:
    """One ONNX node as an onnxruntime session, made once per input signature (dtypes and ranks)."""

    def __init__(self, node: onnx.NodeProto, opsets: Sequence[onnx.OperatorSetIdProto]) -> None:
        self.node, self.opsets = node, list(opsets)
        self._sessions: dict[tuple[tuple[int, int], ...], object] = {}

    def _session(self, inputs: Sequence[Tensor | None]) -> object:
        import onnxruntime as ort

        key = tuple((_elem_type(t), t.dim()) if t is not None else (0, 0) for t in inputs)
        sess = self._sessions.get(key)
        if sess is None:
            ins = [helper.make_tensor_value_info(name, _elem_type(t), None)
                   for name, t in zip(self.node.input, inputs, strict=False) if name and t is not None]
            outs = [helper.make_empty_tensor_value_info(o) for o in self.node.output if o]
            graph = helper.make_graph([self.node], "node", ins, outs)
            # the lowest IR version the opsets allow: onnx's newest can be past what onnxruntime reads
            model = helper.make_model(graph, opset_imports=self.opsets,
                                      ir_version=helper.find_min_ir_version_for(self.opsets, True))
            so = ort.SessionOptions()
            so.log_severity_level = 3
            sess = self._sessions[key] = ort.InferenceSession(model.SerializeToString(), so,
                                                              providers=["CPUExecutionProvider"])
        return sess

    def __call__(self, inputs: Sequence[Tensor | None]) -> list[Tensor]:
        sess = self._session(inputs)
        device = next((t.device for t in inputs if t is not None), torch.device("cpu"))
        feeds = {name: t.detach().cpu().numpy() for name, t in zip(self.node.input, inputs, strict=False)
                 if name and t is not None}
        outs = sess.run([o for o in self.node.output if o], feeds)  # type: ignore[attr-defined]
        return [torch.from_numpy(np.asarray(o)).to(device) for o in outs]


class PluginNode:
    """An operator plugin's node: its ``torch_forward`` (with gradients) when the plugin gives one, else its
    numpy forward on detached values (no gradient, like :class:`OrtNode`)."""

    def __init__(self, node: onnx.NodeProto, op: CustomOp) -> None:
        self.node, self.op = node, op

    def __call__(self, inputs: Sequence[Tensor | None]) -> list[Tensor]:
        device = next((t.device for t in inputs if t is not None), torch.device("cpu"))
        if self.op.torch_forward is not None:
            outs = call(self.op, self.op.torch_forward, self.node, inputs)
            return [o if isinstance(o, torch.Tensor) else torch.as_tensor(np.asarray(o), device=device) for o in outs]
        arrays = run_numpy(self.op, self.node, [t.detach().cpu().numpy() if t is not None else None for t in inputs])
        return [torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in arrays]


def node_runner(node: onnx.NodeProto, opsets: Sequence[onnx.OperatorSetIdProto]) -> OrtNode | PluginNode:
    """How the executor runs a node that has no torch function (or is a plugin op)."""
    op = node_op(node)
    return PluginNode(node, op) if op is not None else OrtNode(node, opsets)
