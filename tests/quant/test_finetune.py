"""Fine-tuning (AdaRound / BRECQ / LSQ): blocks, the bounded sample store, and whole builds of the
tiny CNN: learned weights on the integer grid, determinism, rollback, the cache, the device field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

import pulsar
from pulsar.errors import PulsarError
from pulsar.quant.finetune import resolve_device
from pulsar.quant.finetune.blocks import make_blocks
from pulsar.quant.finetune.guard import compared_tensor
from pulsar.quant.finetune.store import SampleStore
from tests.hostile.harness import Snapshot, assert_clean_failure, run_cli

_RESIDUAL = """<ir_version: 8, opset_import: ["" : 17]>
g (float[1,4,8,8] x) => (float[1,4,8,8] y) {
    w1 = Constant <value = float[4,4,1,1] {%(w)s}> ()
    w2 = Constant <value = float[4,4,1,1] {%(w)s}> ()
    w3 = Constant <value = float[4,4,1,1] {%(w)s}> ()
    w4 = Constant <value = float[4,4,1,1] {%(w)s}> ()
    a = Conv <group = 1> (x, w1)
    r = Relu (a)
    b = Conv (r, w2)
    c = Conv (b, w3)
    s = Add (c, r)
    y = Conv (s, w4)
}""".replace("%(w)s", ",".join(["0.1"] * 16))


_HEADS = """<ir_version: 8, opset_import: ["" : 17]>
g (float[1,8] x) => (float[1,4] p, float[1,4] q, float[1,4] r, float[1,4] f) {
    w = Constant <value = float[8,4] {%(w)s}> ()
    logits = MatMul (x, w)
    p = Softmax <axis = -1> (logits)
    m = ReduceMax <keepdims = 1> (logits)
    d = Sub (logits, m)
    e = Exp (d)
    z = ReduceSum <keepdims = 1> (e)
    q = Div (e, z)
    r = Sigmoid (logits)
    sm = Softmax <axis = -1> (logits)
    f = Flatten <axis = 1> (sm)
}""".replace("%(w)s", ",".join(["0.1"] * 32))


def test_the_whole_model_check_compares_probabilities_as_their_scores() -> None:
    """The whole-model check compares the scores behind a Softmax output, written as one op or as
    jax2tf decomposes it (exp(x - max) / sum), also behind shape-only ops; other outputs (a Sigmoid
    map) as they are."""
    model = onnx.parser.parse_model(_HEADS)
    producer = {o: n for n in model.graph.node for o in n.output}
    assert [compared_tensor(o.name, producer) for o in model.graph.output] == ["logits", "logits", "r", "logits"]


def test_blocks_never_cut_a_residual_branch() -> None:
    model = onnx.parser.parse_model(_RESIDUAL)
    nodes = {n.output[0]: n.name or n.output[0] for n in model.graph.node}
    for i, n in enumerate(model.graph.node):
        n.name = n.name or f"n{i}"
    weights = {n.input[1]: n.name for n in model.graph.node if n.op_type == "Conv"}
    assert nodes
    one = make_blocks(model, weights, 1)
    # the residual group (b, c, s) holds two weighted layers but cannot be cut: one block
    assert [len(b.weights) for b in one] == [1, 2, 1]
    assert one[0].inputs == ["x"] and one[0].outputs == ["r"]
    assert one[1].inputs == ["r"] and one[1].outputs == ["s"]
    assert one[2].outputs == ["y"]
    assert [len(b.weights) for b in make_blocks(model, weights, 3)] == [3, 1]
    assert [len(b.weights) for b in make_blocks(model, weights, 4)] == [4]


def test_store_spills_beyond_its_budget_and_cleans_up(tmp_path: Path) -> None:
    store = SampleStore(tmp_path, budget=3000)
    samples = [{"a": np.full((1, 250), i, np.float32), "b": np.arange(3) + i} for i in range(6)]
    for s in samples:
        store.append(s)
    assert store.spilled >= 3 and len(store) == 6
    for i, s in enumerate(samples):
        got = store[i]
        assert list(got) == ["a", "b"]
        np.testing.assert_array_equal(got["a"], s["a"])
        np.testing.assert_array_equal(got["b"], s["b"])
    store.close()
    assert not any(tmp_path.rglob("*.npy"))


def test_cuda_device_without_cuda_is_a_config_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(PulsarError, match=r"quant\.device.*cuda:0.*no"):
        resolve_device("cuda:0")
    assert resolve_device("cpu").type == "cpu"


def _build(tiny: dict, out: Path, **quant: object) -> pulsar.BuildResult:
    cfg = {"quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                                        "calibration_format": "Numpy", "calibration_size": 8}], **quant}}
    return pulsar.build(input=tiny["model"], output_dir=out, config=cfg, quiet=True)


def _weights(out: Path) -> dict[str, np.ndarray]:
    m = onnx.load(out / "quant" / "quantized.onnx")
    return {t.name: numpy_helper.to_array(t) for t in m.graph.initializer if t.name.endswith("/q")}


def _scales(out: Path) -> dict[str, list]:
    tensors = json.loads((out / "quant" / "quant_config.json").read_text())["tensors"]
    return {k: v["scale"] for k, v in tensors.items()}


@pytest.fixture(scope="module")
def default_build(tiny: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ft") / "default"
    _build(tiny, out)
    return out


@pytest.mark.parametrize("algo", ["adaround", "brecq", "lsq"])
def test_finetuned_build_learns_and_is_deterministic(tiny: dict, tmp_path: Path, default_build: Path,
                                                     algo: str) -> None:
    settings = {f"enable_{algo}": True, "finetune_epochs": 30, "finetune_block_size": 2, "finetune_lr": 3e-3}
    _build(tiny, tmp_path / "a", **settings)
    _build(tiny, tmp_path / "b", **settings)
    for name in ("quant/quantized.onnx", "quant/quant_config.json", "compiled.pulsar"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    log = (tmp_path / "a" / "build.log").read_text()
    assert "block 1/" in log and "loss" in log and "Fine-tuning" in log
    base, tuned = _weights(default_build), _weights(tmp_path / "a")
    assert base.keys() == tuned.keys()
    kept = [line for line in log.splitlines() if "block " in line and "rolled back" not in line and "loss" in line]
    changed = [k for k in base if not np.array_equal(base[k], tuned[k])]
    if algo == "lsq":
        scales_moved = [k for k, v in _scales(tmp_path / "a").items() if v != _scales(default_build)[k]]
        assert scales_moved, "LSQ kept a block but learned no scale"
    else:  # learned rounding: same grid, each integer moved by at most one step
        assert _scales(tmp_path / "a") == _scales(default_build)
        for k in base:
            if "/q" in k and base[k].dtype == np.int8:
                assert np.abs(base[k].astype(int) - tuned[k].astype(int)).max() <= 1, k
    assert kept and changed, log


def test_a_diverging_block_is_rolled_back(tiny: dict, tmp_path: Path, default_build: Path) -> None:
    """LSQ with an absurd learning rate diverges in every block: each ends with its calibrated
    parameters, so the export is the default build's, byte for byte."""
    _build(tiny, tmp_path / "x", enable_lsq=True, finetune_epochs=5, finetune_lr=1e3)
    log = (tmp_path / "x" / "build.log").read_text()
    blocks = [ln for ln in log.splitlines() if "block " in ln and "loss" in ln]
    assert blocks and all("rolled back" in ln for ln in blocks), log
    for name in ("quant/quantized.onnx", "quant/quant_config.json"):
        assert (tmp_path / "x" / name).read_bytes() == (default_build / name).read_bytes(), name


def test_blocks_that_improve_alone_but_not_together_are_undone(tiny: dict, tmp_path: Path,
                                                                default_build: Path) -> None:
    """AdaRound at 30 steps and learning rate 1e-3 lowers block 1's loss, yet the whole tiny model
    ends farther from float on its samples: the whole-model check keeps the calibrated parameters,
    says so in one warning with both errors, and the export is the default build's, byte for byte."""
    _build(tiny, tmp_path / "w", enable_adaround=True, finetune_epochs=30, finetune_block_size=2, finetune_lr=1e-3)
    log = (tmp_path / "w" / "build.log").read_text()
    kept_blocks = [ln for ln in log.splitlines() if "block " in ln and "loss" in ln and "rolled back" not in ln]
    assert kept_blocks, log
    warning = [ln for ln in log.splitlines() if "whole model" in ln]
    assert len(warning) == 1 and "WARNING" in warning[0] and "no better than calibrated" in warning[0], log
    before, after = (float(x) for x in re.search(r"output error (\S+) -> (\S+) ", warning[0]).groups())  # type: ignore[union-attr]
    assert after >= before
    for name in ("quant/quantized.onnx", "quant/quant_config.json"):
        assert (tmp_path / "w" / name).read_bytes() == (default_build / name).read_bytes(), name
    from bench.bench_finetune import parse_build_log  # the bench reads the same summary line

    summary = parse_build_log(tmp_path / "w" / "build.log")["summary"]
    assert summary["undone"] and summary["parameters"] == 0 and summary["rolled_back"] < summary["blocks"], summary


def test_second_build_reuses_the_learned_parameters(tiny: dict, tmp_path: Path) -> None:
    settings = {"enable_adaround": True, "finetune_epochs": 10}
    _build(tiny, tmp_path / "o", **settings)
    first = (tmp_path / "o" / "quant" / "quantized.onnx").read_bytes()
    _build(tiny, tmp_path / "o", **settings)
    log = (tmp_path / "o" / "build.log").read_text()
    assert "from the cache" in log and "block 1/" not in log
    assert (tmp_path / "o" / "quant" / "quantized.onnx").read_bytes() == first
    _build(tiny, tmp_path / "o", **{**settings, "finetune_epochs": 11})  # other settings: trained again
    assert "block 1/" in (tmp_path / "o" / "build.log").read_text()


def test_cuda_on_a_machine_without_it_exits_2_before_writing(tiny: dict, tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    cfg = {"quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                                        "calibration_format": "Numpy"}]}}
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    before = Snapshot.of(tmp_path)
    proc = run_cli(["build", "--input", str(tiny["model"]), "--config", "c.json", "--output_dir", "out",
                    "--quant.enable_lsq", "--quant.device", "cuda:0"], tmp_path)
    assert_clean_failure(proc, ("quant.device", "cuda:0", "CUDA"), before, tmp_path)
