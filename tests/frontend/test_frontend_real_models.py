"""The frontend on real models: the PP-OCRv4 recognizer (Paddle export, opset 12) and torch exports."""

from __future__ import annotations

import importlib.resources
import io

import numpy as np
import onnx
import pytest

from pulsar.errors import PulsarError
from pulsar.frontend.check import random_samples, run
from pulsar.frontend.loader import apply_input_shapes, default_opset, load_model, require_static_inputs
from pulsar.frontend.pass_manager import compare_models, op_histogram, optimize


def _rapidocr_model(name: str):
    pytest.importorskip("rapidocr_onnxruntime")
    path = importlib.resources.files("rapidocr_onnxruntime") / "models" / name
    if not path.is_file():
        pytest.skip(f"{name} is not shipped with this rapidocr-onnxruntime")
    return path


def test_ppocrv4_recognizer_end_to_end():
    path = _rapidocr_model("ch_PP-OCRv4_rec_infer.onnx")
    model = load_model(path)
    assert default_opset(model) == 17
    assert all(n.name for n in model.graph.node)
    (input_name,) = [i.name for i in model.graph.input]
    with pytest.raises(PulsarError, match="input_shapes"):
        require_static_inputs(model)
    model = apply_input_shapes(model, {input_name: [1, 3, 48, 320]})
    require_static_inputs(model)

    optimized, records = optimize(model)
    before, after = op_histogram(model), op_histogram(optimized)
    assert sum(after.values()) < sum(before.values()) * 0.6
    assert before["Constant"] > 100 and "Constant" not in after
    assert "BatchNormalization" not in after and "Shape" not in after and "Cast" not in after
    assert {r.name for r in records if r.changed_iterations} >= {"constant_to_initializer", "fold_batchnorm"}
    assert [o.name for o in optimized.graph.output] == [o.name for o in model.graph.output]
    onnx.checker.check_model(optimized)

    samples = random_samples(model, count=1, seed=42)
    for row in compare_models(model, optimized, samples):
        assert row["rel_diff"] <= 1e-4, row
        assert row["cosine"] > 0.99999


# --- torch exports ------------------------------------------------------------------------------


def _mobilenet_like():
    torch = pytest.importorskip("torch")
    nn = torch.nn

    def block(cin, cout, stride, groups=1):
        return [
            nn.Conv2d(cin, cout, 3, stride, 1, groups=groups, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU6(),
        ]

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.features = nn.Sequential(
                *block(3, 8, 2),
                *block(8, 8, 1, groups=8),  # depthwise
                nn.Conv2d(8, 16, 1, bias=False),
                nn.BatchNorm2d(16),
            )
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(16, 5)

        def forward(self, x):
            y = self.pool(self.features(x))
            return self.fc(y.view(y.size(0), -1))  # exported as a Shape -> Gather -> ... -> Reshape chain

    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():  # non-trivial BN statistics so that folding is really exercised
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    return torch, net.eval()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("fold_in_torch", [False, True], ids=["raw-export", "torch-folded"])
def test_torch_mobilenet_like_export(tmp_path, fold_in_torch):
    torch, net = _mobilenet_like()
    buffer = io.BytesIO()
    torch.onnx.export(
        net,
        torch.randn(1, 3, 32, 32),
        buffer,
        opset_version=17,
        dynamo=False,
        input_names=["x"],
        output_names=["logits"],
        dynamic_axes={"x": {0: "batch"}},
        do_constant_folding=fold_in_torch,
    )
    path = tmp_path / "mbv2_like.onnx"
    path.write_bytes(buffer.getvalue())

    model = apply_input_shapes(load_model(path), {"x": [2, 3, 32, 32]})
    optimized, _ = optimize(model)
    after = op_histogram(optimized)
    for op in ("BatchNormalization", "Constant", "Identity", "Shape", "Gather", "Concat", "Unsqueeze"):
        assert op not in after, after
    assert after["Conv"] == 3 and after["Clip"] == 2

    x = np.random.default_rng(7).standard_normal((2, 3, 32, 32)).astype(np.float32)
    with torch.no_grad():
        expected = net(torch.from_numpy(x)).numpy()
    (got,) = run(optimized, [{"x": x}])
    np.testing.assert_allclose(got["logits"], expected, rtol=1e-4, atol=1e-5)
