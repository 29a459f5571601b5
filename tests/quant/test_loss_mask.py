"""quant.finetune_loss_mask: the masked losses' arithmetic, and the field checked before calibration."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from pulsar.errors import PulsarError
from pulsar.quant.finetune.loss_mask import check_mask_input, mean_square, per_sample_error, squared_error
from tests.hostile.harness import Snapshot, assert_clean_failure, run_cli


def test_only_the_marked_positions_count() -> None:
    want = torch.zeros(2, 4, 3)
    got = torch.zeros(2, 4, 3)
    got[0, 3] = 10.0  # a padding position of sample 0: huge error, not read
    got[1, 0] = 1.0   # a real token of sample 1
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    # 3 features x 1.0^2 over (3 + 2 real positions) x 3 features
    assert squared_error(got, want, mask).item() == pytest.approx(3.0 / 15.0)
    assert squared_error(got, want, None).item() == pytest.approx((3 * 100.0 + 3.0) / 24.0)
    per = per_sample_error(got, want, mask, 2)
    assert per.tolist() == pytest.approx([0.0, 3.0 / 6.0])


def test_tensors_the_mask_does_not_fit_count_whole() -> None:
    mask = torch.tensor([[1.0, 0.0]])
    got, want = torch.ones(1, 5), torch.zeros(1, 5)  # [1, 5]: leading dims are not the mask's [1, 2]
    assert squared_error(got, want, mask).item() == 1.0
    t = np.arange(6, dtype=np.float32).reshape(1, 2, 3)
    assert mean_square(t, np.array([[1.0, 0.0]], np.float32)) == pytest.approx(np.mean(t[0, 0] ** 2))
    assert mean_square(t, np.array([[1.0, 0.0, 1.0]], np.float32)) == pytest.approx(np.mean(t ** 2))


def _model(shape: list[int]) -> onnx.ModelProto:
    dims = ",".join(str(d) for d in shape)
    return onnx.parser.parse_model(f"""<ir_version: 8, opset_import: ["" : 17]>
g (float[1,4] x, int64[{dims}] attention_mask) => (float[1,4] y) {{ y = Relu (x) }}""")


def test_the_field_must_name_an_input_of_rank_two_or_more() -> None:
    check_mask_input(_model([1, 4]), "")
    check_mask_input(_model([1, 4]), "attention_mask")
    with pytest.raises(PulsarError, match=r'quant\.finetune_loss_mask: "mask" is not an input.*x, attention_mask'):
        check_mask_input(_model([1, 4]), "mask")
    with pytest.raises(PulsarError, match=r"quant\.finetune_loss_mask: input \"attention_mask\" has rank 1"):
        check_mask_input(_model([4]), "attention_mask")


def test_a_mask_that_is_no_input_exits_2_before_calibration(tiny: dict, tmp_path: Path) -> None:
    cfg = {"quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                                        "calibration_format": "Numpy"}],
                     "enable_lsq": True, "finetune_loss_mask": "attention_mask"}}
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    before = Snapshot.of(tmp_path)
    proc = run_cli(["build", "--input", str(tiny["model"]), "--config", "c.json", "--output_dir", "out"], tmp_path)
    assert_clean_failure(proc, ("quant.finetune_loss_mask", "attention_mask", "image"), before, tmp_path)
    before_error = proc.stderr.split("error:")[0]
    assert "── quantization ──" in before_error and "calibrated" not in before_error, proc.stderr
