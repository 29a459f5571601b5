"""LSTM / GRU / RNN in the torch executor against onnxruntime: both directions with per-batch
sequence lengths and initial states, peepholes, clip, activations with alpha / beta, and gradients."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from pulsar.quant.torch_exec.ops import TORCH_OPS, Call

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
INPUTS = ["X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"]
SEQ, BATCH, IN, HID = 5, 3, 4, 6


def _arrays(op_type: str, n_dir: int, seed: int = 0, peepholes: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    g = GATES[op_type]

    def f(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32) * 0.5

    arrays = {"X": f(SEQ, BATCH, IN), "W": f(n_dir, g * HID, IN), "R": f(n_dir, g * HID, HID),
              "B": f(n_dir, 2 * g * HID), "sequence_lens": np.array([SEQ, 2, 4], np.int32)[:BATCH],
              "initial_h": f(n_dir, BATCH, HID)}
    if op_type == "LSTM":
        arrays["initial_c"] = f(n_dir, BATCH, HID)
        if peepholes:
            arrays["P"] = f(n_dir, 3 * HID)
    return arrays


def _n_outputs(op_type: str) -> int:
    return 3 if op_type == "LSTM" else 2


def _onnxruntime(op_type: str, attrs: dict[str, Any], arrays: dict[str, np.ndarray]) -> list[np.ndarray]:
    names = [n if n in arrays else "" for n in INPUTS[:max(INPUTS.index(k) for k in arrays) + 1]]
    outs = ["Y", "Y_h", "Y_c"][:_n_outputs(op_type)]
    node = helper.make_node(op_type, names, outs, hidden_size=HID, **attrs)
    elem = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int32): TensorProto.INT32}
    inputs = [helper.make_tensor_value_info(k, elem[v.dtype], v.shape) for k, v in arrays.items()]
    graph = helper.make_graph([node], "rec", inputs,
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    out: list[np.ndarray] = sess.run(None, arrays)
    return out


def _torch(op_type: str, attrs: dict[str, Any], tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    ins: list[torch.Tensor | None] = [tensors.get(n) for n in INPUTS]
    call = Call({"hidden_size": HID, **attrs, "_outputs": _n_outputs(op_type), "_op": op_type}, ins)
    return list(TORCH_OPS[op_type](call))


def _check(op_type: str, attrs: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    want = _onnxruntime(op_type, attrs, arrays)
    got = _torch(op_type, attrs, {k: torch.from_numpy(v) for k, v in arrays.items()})
    for name, g, w in zip(["Y", "Y_h", "Y_c"], got, want, strict=False):
        assert g.shape == w.shape, name
        err = float(np.abs(g.detach().numpy() - w).max())
        assert err <= 1e-5 * max(float(np.ptp(w)), 1e-3), f"{op_type} {name}: {err}"


CASES = [
    ("LSTM", {"direction": "bidirectional"}, True),
    ("LSTM", {"direction": "reverse", "clip": 0.7, "input_forget": 1}, True),
    ("LSTM", {"direction": "forward", "activations": ["HardSigmoid", "ScaledTanh", "Affine"],
              "activation_alpha": [0.3, 0.9, 1.5], "activation_beta": [0.4, 1.1, 0.2]}, False),
    ("GRU", {"direction": "bidirectional"}, False),
    ("GRU", {"direction": "bidirectional", "linear_before_reset": 1, "clip": 1.0}, False),
    ("GRU", {"direction": "forward", "activations": ["Sigmoid", "LeakyRelu"], "activation_alpha": [0.2]}, False),
    ("RNN", {"direction": "bidirectional", "activations": ["Elu", "Softsign"]}, False),
    ("RNN", {"direction": "reverse", "activations": ["ThresholdedRelu"], "activation_alpha": [0.1]}, False),
]


@pytest.mark.parametrize(("op_type", "attrs", "peep"), CASES)
def test_matches_onnxruntime(op_type: str, attrs: dict[str, Any], peep: bool) -> None:
    n_dir = 2 if attrs["direction"] == "bidirectional" else 1
    arrays = _arrays(op_type, n_dir, peepholes=peep)
    _check(op_type, attrs, arrays)
    plain = {k: v for k, v in arrays.items() if k not in ("sequence_lens", "initial_h", "initial_c")}
    _check(op_type, attrs, plain)  # no lengths, zero initial states


@pytest.mark.parametrize("op_type", ["LSTM", "GRU", "RNN"])
def test_layout_1_is_layout_0_transposed(op_type: str) -> None:
    arrays = {k: torch.from_numpy(v) for k, v in _arrays(op_type, 2).items()}
    attrs = {"direction": "bidirectional"}
    ref = _torch(op_type, attrs, arrays)
    swapped = dict(arrays, X=arrays["X"].transpose(0, 1), initial_h=arrays["initial_h"].transpose(0, 1))
    if "initial_c" in arrays:
        swapped["initial_c"] = arrays["initial_c"].transpose(0, 1)
    got = _torch(op_type, {**attrs, "layout": 1}, swapped)
    torch.testing.assert_close(got[0], ref[0].permute(2, 0, 1, 3))
    for g, r in zip(got[1:], ref[1:], strict=True):
        torch.testing.assert_close(g, r.transpose(0, 1))


@pytest.mark.parametrize("op_type", ["LSTM", "GRU", "RNN"])
def test_gradient_reaches_weights(op_type: str) -> None:
    arrays = {k: torch.from_numpy(v) for k, v in _arrays(op_type, 2).items()}
    w = arrays["W"].clone().requires_grad_(True)
    outs = _torch(op_type, {"direction": "bidirectional"}, dict(arrays, W=w))
    (outs[0].square().sum() + outs[1].sum()).backward()
    assert w.grad is not None
    assert torch.isfinite(w.grad).all() and w.grad.abs().sum() > 0
