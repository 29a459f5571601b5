"""A QDQ model lowered and written as a compiled model in one call (tests, tools); the container
format itself is :mod:`pulsar.core.container`."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnx.inliner

from pulsar.compiler.lower import LowerOptions, lower_qdq_model
from pulsar.core.container import package, tensor_infos


def package_qdq_model(model: onnx.ModelProto, path: str | Path, metadata: dict,
                      lut_items_in_bits: int = 10, sub_configs: list | None = None) -> Path:
    """Lower a QDQ model (NPU integer programs + CPU subgraphs) and write it as a compiled model;
    ``sub_configs``: :class:`~pulsar.compiler.lower.model.SubRange` ranges lowered with their own options."""
    if model.functions:
        model = onnx.inliner.inline_local_functions(model)
    lowered = lower_qdq_model(model, LowerOptions(lut_items_in_bits=lut_items_in_bits,
                                                  sub_configs=list(sub_configs or [])))
    for sg in lowered.subgraphs:
        sg.reference = lowered.references.get(sg.name)
    meta = dict(metadata)
    meta.setdefault("inputs", tensor_infos(lowered.inputs))
    meta.setdefault("outputs", tensor_infos(lowered.outputs))
    return package(lowered.subgraphs, inputs=lowered.inputs, outputs=lowered.outputs,
                   opset_imports=lowered.opset_imports, metadata=meta, path=path, ir_version=model.ir_version)
