"""A small real CNN (Conv+BN+Relu, depthwise, residual Add, pooling, Gemm) built with onnx.helper,
plus calibration data, for fast end-to-end and error-path tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def make_tiny_cnn(path: Path, *, seed: int = 0, opset: int = 13, dynamic_batch: bool = False) -> Path:
    rng = np.random.default_rng(seed)

    def init(name: str, *shape: int, scale: float = 0.3) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    inits = [
        init("c1.w", 8, 3, 3, 3), init("c1.b", 8, scale=0.1),
        numpy_helper.from_array((1 + 0.1 * rng.standard_normal(8)).astype(np.float32), "bn.scale"),
        init("bn.bias", 8, scale=0.1), init("bn.mean", 8, scale=0.1),
        numpy_helper.from_array((0.5 + rng.random(8)).astype(np.float32), "bn.var"),
        init("dw.w", 8, 1, 3, 3), init("dw.b", 8, scale=0.1),
        init("c2.w", 8, 8, 1, 1), init("c2.b", 8, scale=0.1),
        init("fc.w", 10, 8), init("fc.b", 10, scale=0.1),
    ]
    nodes = [
        helper.make_node("Conv", ["image", "c1.w", "c1.b"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "bn.scale", "bn.bias", "bn.mean", "bn.var"], ["bn1"],
                         name="bn1"),
        helper.make_node("Relu", ["bn1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "dw.w", "dw.b"], ["dw"], name="dwconv", group=8, pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["dw"], ["r2"], name="relu2"),
        helper.make_node("Conv", ["r2", "c2.w", "c2.b"], ["c2"], name="conv2"),
        helper.make_node("Add", ["c2", "r1"], ["res"], name="residual"),
        helper.make_node("Identity", ["res"], ["res_id"], name="identity"),
        helper.make_node("GlobalAveragePool", ["res_id"], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "fc.w", "fc.b"], ["logits"], name="fc", transB=1),
    ]
    batch = "N" if dynamic_batch else 1
    graph = helper.make_graph(
        nodes, "tiny_cnn",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [batch, 3, 16, 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, 10])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)
    return path


def make_numpy_calibration(folder: Path, n: int = 8, seed: int = 1, shape=(1, 3, 16, 16)) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        np.save(folder / f"{i:03d}.npy", rng.standard_normal(shape).astype(np.float32))
    return folder


def tiny_activations(tiny: dict[str, Path]) -> dict[str, list[np.ndarray]]:
    """Every intermediate tensor of the tiny CNN, one flat array per calibration sample (onnxruntime)."""
    import onnxruntime as ort

    model = onnx.load(tiny["model"])
    names = [o for n in model.graph.node for o in n.output]
    model.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names if n != "logits")
    sess = ort.InferenceSession(model.SerializeToString())
    outs: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for p in sorted(Path(tiny["calib"]).glob("*.npy")):
        for o, v in zip(sess.get_outputs(), sess.run(None, {"image": np.load(p)}), strict=True):
            outs[o.name].append(v.reshape(-1))
    return outs
