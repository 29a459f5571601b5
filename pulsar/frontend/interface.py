"""The model's interface: every graph input and output must be a plain tensor.

A compiled model exchanges tensors with its caller (files in ``pulsar run``, arrays in the API) and
between its subgraphs; sequence, optional, map and sparse values have no such form, so a model that
takes or returns one is refused at load time, before anything is built, instead of failing at run time."""

from __future__ import annotations

import onnx

from pulsar.errors import PulsarError

_KINDS = {"sequence_type": "a sequence", "optional_type": "an optional", "map_type": "a map",
          "sparse_tensor_type": "a sparse tensor"}
_FIX = {
    "input": "feed a tensor instead (e.g. stack the sequence into one tensor and split it in the model)",
    "output": "return a tensor instead (e.g. ConcatFromSequence or SequenceAt before the output, "
              "OptionalGetElement for an optional)",
}


def check_tensor_interface(model: onnx.ModelProto, path: str = "model") -> None:
    """Raise a PulsarError naming the first graph input / output that is not a tensor."""
    inits = {t.name for t in model.graph.initializer}
    for role, values in (("input", [v for v in model.graph.input if v.name not in inits]),
                         ("output", list(model.graph.output))):
        for vi in values:
            kind = vi.type.WhichOneof("value")
            if kind == "tensor_type" or (kind is None and role == "output"):
                continue
            what = _KINDS.get(kind or "", "a value of unknown type")
            raise PulsarError(f"{path}: model {role} '{vi.name}' is {what}; pulsar builds models whose inputs and "
                              f"outputs are tensors only: {_FIX[role]}")
