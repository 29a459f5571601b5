"""Quantization precision analysis on a small CNN quantized by pulsar's own build."""

from __future__ import annotations

import gc
import io
import math
import re
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from rich.console import Console
from rich.table import Table

import pulsar
from pulsar.core.ort_options import reference_session_options
from pulsar.errors import PulsarError
from pulsar.quant.analysis import (
    Accumulator,
    analyze,
    precision_table,
    worst_rows,
    write_mermaid,
    write_table,
)

N_SAMPLES = 6
BAD = "residual"      # the layer made deliberately bad: its output tensor gets a huge scale
BAD_TENSOR = "res"
BAD_CONSUMER = "sigmoid"  # reads the bad tensor directly, so its own input quantization is bad too
DOWNSTREAM = ["conv4", "pool", "flatten", "fc"]


def _cnn(path: Path) -> Path:
    rng = np.random.default_rng(0)

    def w(name: str, *shape: int, s: float = 0.3) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * s).astype(np.float32), name)

    inits = [w("c1.w", 8, 3, 3, 3), w("c1.b", 8, s=0.1), w("c2.w", 8, 8, 3, 3, s=0.2), w("c2.b", 8, s=0.1),
             w("c3.w", 8, 8, 1, 1), w("c3.b", 8, s=0.1), w("c4.w", 8, 8, 3, 3), w("c4.b", 8, s=0.1),
             w("fc.w", 10, 128, s=0.1), w("fc.b", 10, s=0.1)]
    pad = {"pads": [1, 1, 1, 1]}
    nodes = [
        helper.make_node("Conv", ["x", "c1.w", "c1.b"], ["c1"], name="conv1", **pad),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "c2.w", "c2.b"], ["c2"], name="conv2", **pad),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Conv", ["r2", "c3.w", "c3.b"], ["c3"], name="conv3"),
        helper.make_node("Add", ["c3", "r1"], ["res"], name="residual"),
        helper.make_node("Sigmoid", ["res"], ["sig"], name="sigmoid"),
        helper.make_node("Conv", ["sig", "c4.w", "c4.b"], ["c4"], name="conv4", **pad),
        helper.make_node("MaxPool", ["c4"], ["pool"], name="pool", kernel_shape=[4, 4], strides=[4, 4]),
        helper.make_node("Flatten", ["pool"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "fc.w", "fc.b"], ["logits"], name="fc", transB=1),
    ]
    graph = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("analysis")
    calib = root / "calib"
    calib.mkdir()
    rng = np.random.default_rng(1)
    for i in range(8):
        np.save(calib / f"{i:03d}.npy", rng.standard_normal((1, 3, 16, 16)).astype(np.float32))
    cfg = {"quant": {"input_configs": [{"tensor_name": "x", "calibration_dataset": str(calib),
                                        "calibration_format": "Numpy", "calibration_size": 8}]}}
    pulsar.build(_cnn(root / "cnn.onnx"), root / "out", cfg, quiet=True)
    rng = np.random.default_rng(2)
    return {"float": onnx.load(root / "out" / "frontend" / "optimized.onnx"),
            "qdq": onnx.load(root / "out" / "quant" / "quantized.onnx"),
            "samples": [{"x": rng.standard_normal((1, 3, 16, 16)).astype(np.float32)} for _ in range(N_SAMPLES)]}


def _with_bad_scale(qdq: onnx.ModelProto, tensor: str, scale: float = 1e4) -> onnx.ModelProto:
    bad = onnx.ModelProto()
    bad.CopyFrom(qdq)
    init = next(t for t in bad.graph.initializer if t.name == f"{tensor}/scale")
    init.CopyFrom(numpy_helper.from_array(np.array(scale, dtype=np.float32), init.name))
    return bad


def _by_node(rows: list) -> dict:
    return {r.node: r for r in rows}


def _run(model: onnx.ModelProto, feeds: dict, outputs: list[str], *, reference: bool) -> list[np.ndarray]:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    known = {o.name for o in m.graph.output}
    m.graph.output.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs
                          if n not in known)
    opts = reference_session_options() if reference else ort.SessionOptions()
    sess = ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(outputs, feeds)


def test_rows_follow_float_graph(built: dict) -> None:
    rows = analyze(built["float"], built["qdq"], built["samples"], method="EndToEnd")
    assert [r.node for r in rows] == [n.name for n in built["float"].graph.node]
    r = _by_node(rows)
    assert r["conv2"].tensor == "c2" and r["conv2"].shape == (1, 8, 16, 16) and r["conv2"].dtype == "FP32"
    # conv2's Relu is fused: its output stays float in the QDQ model; the Relu's output is U8
    assert r["conv2"].qdtype == "FP32" and r["relu2"].qdtype == "U8"
    assert r["flatten"].shape == (1, 128)
    assert all(x.cosine > 0.99 for x in rows)


def test_end_to_end_last_layer_matches_model_outputs(built: dict) -> None:
    rows = analyze(built["float"], built["qdq"], iter(built["samples"]), method="EndToEnd")
    cos = []
    for s in built["samples"]:
        (a,) = _run(built["float"], s, ["logits"], reference=False)
        (b,) = _run(built["qdq"], s, ["logits"], reference=True)
        a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
        cos.append(a64 @ b64 / (np.linalg.norm(a64) * np.linalg.norm(b64)))
    last = rows[-1]
    assert last.node == "fc" and last.tensor == "logits"
    assert last.cosine == pytest.approx(float(np.mean(cos)), abs=1e-6)
    assert last.cosine < 1.0


def test_per_layer_output_quantization_only_for_float_inputs(built: dict) -> None:
    """relu1 reads conv1's float output (the pair is fused, c1 is not quantized), so in PerLayer its
    error is exactly the quantization of r1 with r1's own scale / zero point."""
    rows = _by_node(analyze(built["float"], built["qdq"], built["samples"][:1], method="PerLayer"))
    inits = {t.name: numpy_helper.to_array(t) for t in built["qdq"].graph.initializer}
    scale, zp = float(inits["r1/scale"]), int(inits["r1/zero_point"])
    (r1,) = _run(built["float"], built["samples"][0], ["r1"], reference=False)
    deq = (np.clip(np.round(r1 / np.float32(scale)) + zp, 0, 255) - zp) * np.float32(scale)
    a, b = r1.astype(np.float64).ravel(), deq.astype(np.float64).ravel()
    assert rows["relu1"].cosine == pytest.approx(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)), abs=1e-7)
    assert rows["relu1"].mse == pytest.approx(np.mean((a - b) ** 2), rel=1e-3)
    # conv1 in PerLayer is the Conv on the quantized input with quantized weights: not exact
    assert 0.99 < rows["conv1"].cosine < 1.0


def test_per_layer_isolates_a_bad_layer(built: dict) -> None:
    bad = _with_bad_scale(built["qdq"], BAD_TENSOR)
    per = _by_node(analyze(built["float"], bad, built["samples"], method="PerLayer"))
    e2e = _by_node(analyze(built["float"], bad, built["samples"], method="EndToEnd"))
    assert worst_rows(list(per.values()), 1)[0].node == BAD
    assert per[BAD].cosine < 0.1
    others = [r.cosine for n, r in per.items() if n != BAD]
    assert min(others) > per[BAD].cosine + 0.5
    # the direct consumer reads the bad tensor's own Q/DQ in both methods
    assert per[BAD_CONSUMER].cosine < 0.99
    for name in DOWNSTREAM:
        assert per[name].cosine > 0.999, name      # fed float inputs: unaffected
        assert e2e[name].cosine < 0.99, name       # the error propagates end to end
    # layers before the bad one are identical in both runs of the good model and the bad one
    good = _by_node(analyze(built["float"], built["qdq"], built["samples"], method="PerLayer"))
    for name in ("conv1", "relu1", "conv2", "relu2", "conv3"):
        assert per[name].cosine == pytest.approx(good[name].cosine, abs=1e-12)
        assert good[name].cosine > 0.999


def test_metrics_against_numpy() -> None:
    rng = np.random.default_rng(3)
    pairs = [(rng.standard_normal((2, 5)).astype(np.float32), rng.standard_normal((2, 5)).astype(np.float32))
             for _ in range(3)]
    acc = Accumulator()
    for a, b in pairs:
        acc.add(a, b)
    a_all = np.concatenate([a.astype(np.float64).ravel() for a, _ in pairs])
    b_all = np.concatenate([b.astype(np.float64).ravel() for _, b in pairs])
    cos = np.mean([np.dot(a.ravel().astype(np.float64), b.ravel().astype(np.float64))
                   / (np.linalg.norm(a.astype(np.float64)) * np.linalg.norm(b.astype(np.float64)))
                   for a, b in pairs])
    assert acc.cosine == pytest.approx(cos, rel=1e-12)
    assert acc.mse == pytest.approx(np.mean((a_all - b_all) ** 2), rel=1e-12)
    assert acc.sqnr_db == pytest.approx(10 * np.log10(np.sum(a_all**2) / np.sum((a_all - b_all) ** 2)), rel=1e-12)

    same = Accumulator()
    same.add(pairs[0][0], pairs[0][0])
    assert same.cosine == pytest.approx(1.0) and same.mse == 0.0 and same.sqnr_db == math.inf
    zeros = Accumulator()
    zeros.add(np.zeros(4), np.zeros(4))
    assert zeros.cosine == 1.0 and zeros.sqnr_db == math.inf
    one_zero = Accumulator()
    one_zero.add(np.ones(4), np.zeros(4))
    assert one_zero.cosine == 0.0 and one_zero.sqnr_db == pytest.approx(0.0)
    with pytest.raises(ValueError, match="shape"):
        Accumulator().add(np.zeros(3), np.zeros(4))


def test_samples_are_streamed(built: dict) -> None:
    """A generator is consumed one sample at a time: sample k-2 is freed before sample k is made."""
    alive: list[weakref.ref] = []
    made = 0

    def gen() -> Iterator[dict]:
        nonlocal made
        rng = np.random.default_rng(4)
        for _ in range(5):
            gc.collect()
            assert sum(r() is not None for r in alive) <= 1
            x = rng.standard_normal((1, 3, 16, 16)).astype(np.float32)
            alive.append(weakref.ref(x))
            made += 1
            yield {"x": x}

    rows = analyze(built["float"], built["qdq"], gen(), method="PerLayer")
    assert made == 5 and len(rows) == len(built["float"].graph.node)


def test_user_errors(built: dict) -> None:
    f, q, s = built["float"], built["qdq"], built["samples"]
    with pytest.raises(PulsarError, match='did you mean "PerLayer"'):
        analyze(f, q, s, method="Perlayer")
    with pytest.raises(PulsarError, match='unknown input "y"'):
        analyze(f, q, [{"y": s[0]["x"]}])
    with pytest.raises(PulsarError, match="lacks input"):
        analyze(f, q, [{}])
    with pytest.raises(PulsarError, match="no samples"):
        analyze(f, q, iter([]))
    with pytest.raises(PulsarError, match="sample 0 cannot be run"):
        analyze(f, q, [{"x": np.zeros((1, 3, 8, 8), dtype=np.float32)}])


def test_qdtype_from_quant_json(built: dict) -> None:
    qj = {"tensors": {"r1": {"dtype": "S8"}}}
    rows = _by_node(analyze(built["float"], built["qdq"], built["samples"][:1], quant_json=qj))
    assert rows["relu1"].qdtype == "S8" and rows["relu2"].qdtype == "U8"


def test_table(built: dict, tmp_path: Path) -> None:
    rows = analyze(built["float"], _with_bad_scale(built["qdq"], BAD_TENSOR), built["samples"][:2])
    path = tmp_path / "sub" / "precision.txt"
    text = write_table(rows, path)
    assert path.read_text() == text
    lines = text.splitlines()
    assert lines[0] == "Quant Precision Table"
    for col in ("Operator", "Type", "Output Tensor", "Shape", "DType", "QDType", "Cosine", "MSE", "SQNR (dB)"):
        assert col in lines[1]
    assert len(lines) == 3 + len(rows)
    bad_line = next(line for line in lines[3:] if line.startswith(BAD + " "))
    assert "1x8x16x16" in bad_line and "U16" in bad_line  # Add + Sigmoid: a 16-bit epilogue input
    assert not list(tmp_path.glob("sub/.*.tmp"))
    rows[0].node = "conv[red]1"  # rich markup characters are shown as written
    t = precision_table(rows, "PerLayer")
    assert isinstance(t, Table) and t.row_count == len(rows) and len(t.columns) == 9
    console = Console(width=300, record=True, file=io.StringIO())
    console.print(t)
    out = console.export_text()
    assert "conv[red]1" in out and "PerLayer" in out and f"{rows[0].cosine:.6f}" in out


def _parse_mermaid(text: str) -> tuple[set[str], list[tuple[str, str]], dict[str, str]]:
    declared, edges, classes = set(), [], {}
    for line in text.splitlines()[1:]:
        s = line.strip()
        if m := re.fullmatch(r"(\S+) (-->|-\.->) (\S+)", s):
            edges.append((m.group(1), m.group(3)))
        elif m := re.fullmatch(r'([A-Za-z0-9_]+)(\["|\(\["|\[)(.*)', s):
            declared.add(m.group(1))
        elif m := re.fullmatch(r"class (\S+) (\w+)", s):
            for nid in m.group(1).split(","):
                classes[nid] = m.group(2)
    return declared, edges, classes


def test_mermaid(built: dict, tmp_path: Path) -> None:
    f = built["float"]
    rows = analyze(f, _with_bad_scale(built["qdq"], BAD_TENSOR), built["samples"][:2])
    path = tmp_path / "precision.mmd"
    text = write_mermaid(f, rows, path, worst=3)
    assert path.read_text() == text
    assert text.startswith("flowchart TD\n")
    declared, edges, classes = _parse_mermaid(text)
    assert all(re.fullmatch(r"[A-Za-z0-9_]+", d) for d in declared)
    op_ids = {d for d in declared if d.startswith("N")}
    assert len(op_ids) == len(f.graph.node)
    assert edges and all(a in declared and b in declared for a, b in edges)
    # one edge per tensor hop: x -> conv1, conv1 -> relu1, ..., residual reads conv3 and relu1
    ids = {n.name: next(d for d in op_ids if d.split("_", 1)[1] == n.name) for n in f.graph.node}
    assert (ids["conv3"], ids["residual"]) in edges and (ids["relu1"], ids["residual"]) in edges
    worst = worst_rows(rows, 3)
    assert worst[0].node == BAD
    for r in worst:
        assert classes[ids[r.node]] == "worst"
        assert any(a.startswith("W") and b == ids[r.node] for a, b in edges)
    assert "subgraph WORST" in text and "cos 0.0000" in text
    assert classes[ids["conv4"]] == "good"


def test_mermaid_escapes_names(built: dict, tmp_path: Path) -> None:
    f = onnx.ModelProto()
    f.CopyFrom(built["float"])
    f.graph.node[0].name = 'conv "1" [a]<b>|c#'
    rows = analyze(f, built["qdq"], built["samples"][:1])
    text = write_mermaid(f, rows, tmp_path / "g.mmd")
    line = next(s for s in text.splitlines() if "conv #quot;1#quot;" in s and s.strip().startswith("N0_"))
    nid, label = line.strip().split("[", 1)
    assert re.fullmatch(r"N0_conv__1___a__b__c_", nid)
    inner = label[1:-2]  # strip '"' ... '"]'
    assert not re.search(r'["\[\]|]', inner) and "#91;a#93;" in inner and "#lt;b#gt;" in inner
