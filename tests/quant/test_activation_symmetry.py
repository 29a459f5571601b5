"""layer_configs activation_symmetric: zero point in the middle (symmetric) or fitted (affine), for
unsigned and signed grids, through the QDQ model, the compiled model and the simulator."""

from __future__ import annotations

import json

import numpy as np
import pytest

import pulsar
from pulsar.quant.scheme import activation_quant


def test_the_four_grid_shapes():
    u_aff = activation_quant("t", -1.0, 3.0, "U8")
    u_sym = activation_quant("t", -1.0, 3.0, "U8", symmetric=True)
    s_sym = activation_quant("t", -1.0, 3.0, "S8")
    s_aff = activation_quant("t", -1.0, 3.0, "S8", symmetric=False)
    assert int(u_aff.zero_point) == 64 and not u_aff.symmetric
    assert int(u_sym.zero_point) == 128 and u_sym.symmetric and np.isclose(u_sym.scale, 3.0 / 127)
    assert int(s_sym.zero_point) == 0 and np.isclose(s_sym.scale, 3.0 / 127)
    assert int(s_aff.zero_point) == -64 and not s_aff.symmetric and np.isclose(s_aff.scale, 4.0 / 255)
    for tq in (u_aff, u_sym, s_sym, s_aff):  # zero is exact, the range is covered
        assert tq.qmin <= int(tq.zero_point) <= tq.qmax
        assert (tq.qmin - int(tq.zero_point)) * float(tq.scale) <= -1.0 + 1e-6
        assert (tq.qmax - int(tq.zero_point)) * float(tq.scale) >= 3.0 - 0.02


@pytest.mark.parametrize("data_type, symmetric, zp", [("U8", True, 128), ("S8", False, None)])
def test_a_layer_entry_sets_the_grid_shape_and_simulates_exactly(tmp_path, tiny, tiny_config, data_type, symmetric,
                                                                 zp):
    entry = {"start_tensor_names": "DEFAULT", "end_tensor_names": "DEFAULT", "data_type": data_type,
             "activation_symmetric": symmetric}
    cfg = {"quant": {**tiny_config["quant"], "layer_configs": [entry]}}
    res = pulsar.build(tiny["model"], tmp_path / "out", cfg, {"compiler.check": 2}, quiet=True)
    acts = {k: v for k, v in json.loads(res.quant_config.read_text())["tensors"].items() if v["kind"] == "activation"}
    assert acts and all(v["dtype"] == data_type and v["policy"]["SYMMETRICAL"] == symmetric for v in acts.values())
    if zp is not None:
        assert all(v["zero_point"] == zp for v in acts.values())
    else:  # affine S8: most zero points move off 0 (a Relu output starts at 0: zero point -128)
        assert sum(v["zero_point"] != 0 for v in acts.values()) >= len(acts) // 2
    x = np.load(sorted(tiny["calib"].glob("*.npy"))[0])
    ref = pulsar.Session(res.compiled_model, mode="Reference").run({"image": x})["logits"]
    npu = pulsar.Session(res.compiled_model).run({"image": x})["logits"]
    assert np.array_equal(ref, npu)
    assert "compiled: 9 of 9 model ops on the NPU" in (tmp_path / "out" / "build.log").read_text()
