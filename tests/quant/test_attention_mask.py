"""Attention masks and transformer presets: recognition on hand-made graphs, and a masked attention
block built at the default config stays close to float (it collapses when the mask is quantized)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import pulsar
from pulsar.quant.attention import MASK_MARGIN, masked_range, masked_scores, true_scores
from pulsar.quant.layer_configs import resolve_layer_precision
from pulsar.quant.transformer import MASK_REASON, transformer_presets, transformer_stream

L = 8
F32_MIN = float(np.finfo(np.float32).min)


def _const(name: str, value: float | np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, np.float32), name)


def _scores_graph(mask_nodes: list[onnx.NodeProto], combine: onnx.NodeProto, inits: list[onnx.TensorProto],
                  mask_input: bool = True) -> onnx.ModelProto:
    """scores = q @ k^T (two float inputs), combined with a mask, then Softmax."""
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1], name="kt"),
             helper.make_node("MatMul", ["q", "kt"], ["scores"], name="qk"),
             *mask_nodes, combine,
             helper.make_node("Softmax", ["masked"], ["probs"], axis=-1, name="softmax")]
    inputs = [helper.make_tensor_value_info("q", TensorProto.FLOAT, [1, L, 4]),
              helper.make_tensor_value_info("k", TensorProto.FLOAT, [1, L, 4])]
    if mask_input:
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.INT64, [1, L]))
    g = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [1, L, L])],
                          initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _hf_mul() -> onnx.ModelProto:  # (1 - mask) * finfo.min, added
    return _scores_graph(
        [helper.make_node("Cast", ["mask"], ["mf"], to=TensorProto.FLOAT, name="cast"),
         helper.make_node("Unsqueeze", ["mf", "ax"], ["mu"], name="unsq"),
         helper.make_node("Sub", ["one", "mu"], ["inv"], name="inv"),
         helper.make_node("Mul", ["inv", "big"], ["bias"], name="scale")],
        helper.make_node("Add", ["scores", "bias"], ["masked"], name="add_mask"),
        [_const("one", 1.0), _const("big", F32_MIN), numpy_helper.from_array(np.array([1], np.int64), "ax")])


def _where_bias() -> onnx.ModelProto:  # Where(mask == 0, -inf, 0), added
    return _scores_graph(
        [helper.make_node("Equal", ["mask", "zero_i"], ["is_pad"], name="eq"),
         helper.make_node("Where", ["is_pad", "ninf", "zero"], ["bias"], name="where")],
        helper.make_node("Add", ["bias", "scores"], ["masked"], name="add_mask"),
        [_const("ninf", -np.inf), _const("zero", 0.0), numpy_helper.from_array(np.array(0, np.int64), "zero_i")])


def _masked_fill() -> onnx.ModelProto:  # boolean mask: Where(keep, scores, -1e9)
    return _scores_graph(
        [helper.make_node("Cast", ["mask"], ["keep"], to=TensorProto.BOOL, name="cast"),
         helper.make_node("Unsqueeze", ["keep", "ax"], ["keep3"], name="unsq")],
        helper.make_node("Where", ["keep3", "scores", "fill"], ["masked"], name="fill_mask"),
        [_const("fill", -1e9), numpy_helper.from_array(np.array([1], np.int64), "ax")])


def _causal_const() -> onnx.ModelProto:  # a baked causal mask, subtracted as a positive constant
    causal = np.triu(np.full((L, L), 1e4, np.float32), 1)
    return _scores_graph([], helper.make_node("Sub", ["scores", "causal"], ["masked"], name="sub_mask"),
                         [_const("causal", causal)], mask_input=False)


@pytest.mark.parametrize(("make", "node", "branch"), [
    (_hf_mul, "add_mask", {"cast", "unsq", "inv", "scale"}),
    (_where_bias, "add_mask", {"eq", "where"}),
    (_masked_fill, "fill_mask", {"cast", "unsq"}),
    (_causal_const, "sub_mask", set()),
])
def test_mask_forms_are_recognised(make, node: str, branch: set[str]) -> None:
    model = make()
    onnx.checker.check_model(model, full_check=True)
    [found] = masked_scores(model)
    assert (found.node, found.scores, found.output, set(found.branch)) == (node, "scores", "masked", branch)
    presets = transformer_presets(model, 0)
    assert {n for n, p in presets.items() if p.data_type == "FP32"} == {node, *branch}
    assert all(presets[n].why == MASK_REASON for n in (node, *branch))


def _model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto], output: str, shape: list[int],
           inits: list[onnx.TensorProto]) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info(output, TensorProto.FLOAT, shape)],
                          initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_a_view_between_mask_and_softmax_is_on_the_masked_path() -> None:
    model = _hf_mul()
    softmax = model.graph.node[-1]
    softmax.input[0] = "viewed"
    model.graph.node.insert(len(model.graph.node) - 1,
                            helper.make_node("Reshape", ["masked", "shape"], ["viewed"], name="view"))
    model.graph.initializer.append(numpy_helper.from_array(np.array([1, L, L], np.int64), "shape"))
    [found] = masked_scores(model)
    assert found.path == ("masked", "viewed")


def test_stacked_masks_are_both_found_and_the_scores_are_the_unmasked_ones() -> None:
    """GPT-2 style: a causal masked fill, then the padding mask added."""
    model = _hf_mul()
    add = next(n for n in model.graph.node if n.name == "add_mask")
    add.input[0] = "causal_scores"
    model.graph.node.insert(2, helper.make_node("Where", ["causal", "scores", "big"], ["causal_scores"], name="fill"))
    model.graph.initializer.append(numpy_helper.from_array(np.tril(np.ones((L, L), bool)), "causal"))
    masks = {m.node: m for m in masked_scores(model)}
    assert set(masks) == {"fill", "add_mask"}
    assert masks["add_mask"].scores == "causal_scores" and true_scores(list(masks.values()), masks["add_mask"]) == "scores"


def _ln(name: str, x: str, y: str) -> onnx.NodeProto:
    return helper.make_node("LayerNormalization", [x, "gamma", "beta"], [y], axis=-1, name=name)


def test_layernorms_around_an_mlp_without_attention_are_not_a_transformer() -> None:
    """An embedding head (LayerNorm -> Gemm -> Relu -> Gemm -> LayerNorm) keeps the CNN defaults."""
    nodes = [_ln("ln1", "x", "a"), helper.make_node("Gemm", ["a", "w1"], ["b"], name="fc1"),
             helper.make_node("Relu", ["b"], ["c"], name="relu"), helper.make_node("Gemm", ["c", "w2"], ["d"], name="fc2"),
             _ln("ln2", "d", "y")]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])], "y", [1, 8],
                   [_const("w1", np.ones((8, 8))), _const("w2", np.ones((8, 8))), _const("gamma", np.ones(8)),
                    _const("beta", np.zeros(8))])
    assert transformer_stream(model) == [] and transformer_presets(model, 0) == {}


def _attention_block() -> onnx.ModelProto:
    """ln0 -> (x @ x^T softmax) @ x -> proj -> + ln0 -> ln1: one attention block between two LayerNorms."""
    nodes = [_ln("ln0", "x", "h"), helper.make_node("Transpose", ["h"], ["ht"], perm=[0, 2, 1], name="t"),
             helper.make_node("MatMul", ["h", "ht"], ["s"], name="qk"), helper.make_node("Softmax", ["s"], ["p"], name="sm"),
             helper.make_node("MatMul", ["p", "h"], ["ctx"], name="pv"),
             helper.make_node("MatMul", ["ctx", "w"], ["o"], name="proj"), helper.make_node("Add", ["o", "h"], ["r"], name="res"),
             _ln("ln1", "r", "y")]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, L, 8])], "y", [1, L, 8],
                  [_const("w", np.ones((8, 8))), _const("gamma", np.ones(8)), _const("beta", np.zeros(8))])


def test_stream_presets_only_raise_the_default() -> None:
    model = _attention_block()
    assert set(transformer_stream(model)) == {"ln0", "ln1", "qk", "pv", "proj", "res"}
    plain = resolve_layer_precision([], model)
    assert (plain["proj"].data_type, plain["proj"].weights) == ("U16", "S8") and plain["sm"].data_type == "U8"
    highest = resolve_layer_precision([], model, highest_mix_precision=True)
    assert {(p.data_type, p.weights) for p in highest.values()} == {("U16", "S16")}


def test_a_bias_or_a_mask_built_from_activations_is_not_a_mask() -> None:
    small = _scores_graph([], helper.make_node("Add", ["scores", "b"], ["masked"], name="bias"), [_const("b", -3.0)],
                          mask_input=False)
    assert masked_scores(small) == []
    # a large constant mixed with a learned activation (a MatMul) is not a mask branch
    learned = _scores_graph([helper.make_node("MatMul", ["q", "w"], ["qw"], name="proj"),
                             helper.make_node("Mul", ["qw", "big"], ["bias"], name="scale")],
                            helper.make_node("Add", ["scores", "bias"], ["masked"], name="add"),
                            [_const("w", np.ones((4, L))), _const("big", -1e5)], mask_input=False)
    assert masked_scores(learned) == []


def test_masked_range_saturates_below_the_scores() -> None:
    assert masked_range((-3.0, 5.0)) == (-3.0 - MASK_MARGIN, 5.0)
    assert masked_range((1.0, 5.0)) == (1.0 - MASK_MARGIN, 5.0)
    lo, hi = masked_range((0.5, 0.75))
    assert lo <= 0.0 <= hi


def test_layer_configs_name_beats_the_mask_preset() -> None:
    model = _hf_mul()

    from pulsar.config.generated import LayerConfig

    prec = resolve_layer_precision([LayerConfig(layer_name="add_mask", data_type="U16")], model)
    assert prec["add_mask"].data_type == "U16" and prec["scale"].data_type == "FP32"


# ------------------------------------------------------------------ a masked attention block, built


def _block(path: Path) -> Path:
    """x [1, L, 32] + mask [1, L] -> LayerNorm(x + attention(x)) -> LayerNorm(h + ffn(h)), HF-style mask."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(32, 32) for _ in range(4))
            self.ln1, self.ln2 = nn.LayerNorm(32), nn.LayerNorm(32)
            self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            bias = (1.0 - mask.to(torch.float32)[:, None, :]) * torch.finfo(torch.float32).min
            att = torch.softmax(self.q(x) @ self.k(x).transpose(1, 2) / 32**0.5 + bias, -1) @ self.v(x)
            h = self.ln1(x + self.o(att))
            return self.ln2(h + self.down(nn.functional.gelu(self.up(h))))

    torch.manual_seed(0)
    block = Block().eval()
    with torch.no_grad():  # peaked attention, as in a trained model: a uniform Softmax would hide a lost mask
        block.q.weight.mul_(6.0)
    x, mask = torch.zeros(1, L, 32), torch.ones(1, L, dtype=torch.int64)
    torch.onnx.export(block, (x, mask), str(path), input_names=["x", "mask"], output_names=["y"], opset_version=17,
                      dynamo=False)
    return path


def _samples(n: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        real = int(rng.integers(2, L + 1))
        mask = (np.arange(L) < real).astype(np.int64)[None]
        out.append({"x": rng.normal(0, 1, (1, L, 32)).astype(np.float32), "mask": mask})
    return out


WHOLE_U16 = {"quant.layer_configs": [{"start_tensor_names": ["DEFAULT"], "end_tensor_names": ["DEFAULT"],
                                       "data_type": "U16"}]}


@pytest.mark.parametrize("overrides", [{}, {"quant.transformer_opt_level": 1}, WHOLE_U16],
                         ids=["default", "softmax-on-npu", "mask-quantized"])
def test_masked_block_stays_close_to_float(tmp_path: Path, overrides: dict) -> None:
    """Default: the mask in float. Level 1: the NPU Softmax reads the masked scores on the widened
    scores' range. A whole-model U16 range quantizes the mask too: it saturates where it pushes any
    score to the bottom of the grid (quantized over -3.4e38 it would not even compile)."""
    model = _block(tmp_path / "block.onnx")
    for name in ("x", "mask"):
        (tmp_path / "calib" / name).mkdir(parents=True)
    for i, s in enumerate(_samples(16, 0)):
        for name, v in s.items():
            np.save(tmp_path / "calib" / name / f"{i:02d}.npy", v)
    cfg = {"quant": {"input_configs": [{"tensor_name": n, "calibration_dataset": str(tmp_path / "calib" / n),
                                        "calibration_format": "Numpy", "calibration_size": 16} for n in ("x", "mask")]}}
    pulsar.build(input=model, output_dir=tmp_path / "out", config=cfg, overrides=overrides, quiet=True)
    float_sess = ort.InferenceSession(str(model))
    npu = pulsar.Session(tmp_path / "out" / "compiled.pulsar")
    for s in _samples(8, 1):
        ref = float_sess.run(None, s)[0].ravel()
        got = np.asarray(next(iter(npu.run(s).values()))).ravel()
        cos = float(ref @ got / np.linalg.norm(ref) / np.linalg.norm(got))
        assert cos >= 0.99, cos
    qcfg = json.loads((tmp_path / "out" / "quant" / "quant_config.json").read_text())
    mask_nodes = [n for n, v in qcfg["nodes"].items() if MASK_REASON in json.dumps(v)]
    assert bool(mask_nodes) == (overrides is not WHOLE_U16), "the mask ops are on the CPU with their reason"
    [found] = masked_scores(onnx.load(tmp_path / "out" / "frontend" / "optimized.onnx"))
    if found.output in qcfg["tensors"]:  # quantized for an NPU Softmax: the scores' range widened below
        t = qcfg["tensors"][found.output]
        assert t["dtype"] == "U16" and -1e3 < t["range"][0] <= -MASK_MARGIN, t["range"]
    stream = transformer_stream(onnx.load(tmp_path / "out" / "frontend" / "optimized.onnx"))
    assert stream, "the block's residual stream is raised to 16 bits"


def test_a_float_mask_fed_as_a_model_input_is_a_mask() -> None:
    """ONNX Attention's expanded form: scores + attn_mask (a float input holding 0 / -inf rows)."""
    model = _scores_graph([], helper.make_node("Add", ["scores", "attn_mask"], ["masked"], name="add_mask"), [],
                          mask_input=False)
    model.graph.input.append(helper.make_tensor_value_info("attn_mask", TensorProto.FLOAT, [L, L]))
    [found] = masked_scores(model)
    assert (found.node, found.scores, found.mask) == ("add_mask", "scores", "attn_mask")
    # two computed tensors added (a learned bias on the scores) stay as they are
    model.graph.node.insert(0, helper.make_node("MatMul", ["q", "kt"], ["bias"], name="bias"))
    model.graph.node[-2].input[1] = "bias"
    assert masked_scores(model) == []


def test_a_model_input_that_also_feeds_the_network_is_not_a_mask() -> None:
    """Softmax(x @ W + x): x is data (the MatMul reads it too), so the Add stays an ordinary Add."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["s"], name="proj"),
             helper.make_node("Add", ["s", "x"], ["masked"], name="add"),
             helper.make_node("Softmax", ["masked"], ["probs"], axis=-1, name="softmax")]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, L, L])], "probs", [1, L, L],
                   [_const("w", np.eye(L))])
    assert masked_scores(model) == []


def test_p_times_v_counts_only_behind_a_masked_softmax() -> None:
    from pulsar.quant.shifts import weighted_sums

    def attention(masked: bool) -> onnx.ModelProto:
        scores = "masked" if masked else "scores"
        nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1], name="kt"),
                 helper.make_node("MatMul", ["q", "kt"], ["scores"], name="qk"),
                 *([helper.make_node("Add", ["scores", "attn_mask"], ["masked"], name="add_mask")] if masked else []),
                 helper.make_node("Softmax", [scores], ["probs"], axis=-1, name="softmax"),
                 helper.make_node("MatMul", ["probs", "v"], ["out"], name="pv")]
        inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, L, 4]) for n in ("q", "k", "v")]
        if masked:
            inputs.append(helper.make_tensor_value_info("attn_mask", TensorProto.FLOAT, [L, L]))
        return _model(nodes, inputs, "out", [1, L, 4], [])

    assert weighted_sums(attention(masked=False)) == []  # a diffuse unmasked head is no reason for 16 bits
    assert weighted_sums(attention(masked=True)) == [("pv", "v", "out")]
