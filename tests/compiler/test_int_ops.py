"""The ``pulsar.int`` op schemas registered with onnx: the checker and shape inference accept the NPU
bodies of a real compiled model, reject a body with a wrong attribute, arity or output type, and every
op of NPU bodies has exactly one schema / cost rule / kernel."""

from __future__ import annotations

import copy
from collections.abc import Callable

import onnx
import pytest
from onnx import TensorProto, helper

import pulsar
from pulsar.compiler.workload import COST_RULES
from pulsar.core.container import SUBGRAPH_KINDS, load_compiled
from pulsar.core.int_ops import INT_DOMAIN, INT_OPS
from pulsar.runtime.kernels import DOMAINS, KERNELS, register

_CONTAINER_DOMAINS = {k.domain for k in SUBGRAPH_KINDS.values()}


def body_model(body: onnx.GraphProto, opsets: list[onnx.OperatorSetIdProto], ir_version: int) -> onnx.ModelProto:
    """A standalone model of an NPU body (its weights copied in), as onnx tools would open it."""
    model = helper.make_model(copy.deepcopy(body), opset_imports=[o for o in opsets
                                                                   if o.domain not in _CONTAINER_DOMAINS])
    model.ir_version = ir_version
    return model


@pytest.fixture(scope="module")
def npu_bodies(tiny, tmp_path_factory) -> list[onnx.ModelProto]:
    cfg = {"quant": {"input_configs": [{"tensor_name": "image", "calibration_dataset": str(tiny["calib"]),
                                        "calibration_format": "Numpy", "calibration_size": 8}]},
           "compiler": {"check": 0}}
    res = pulsar.build(tiny["model"], tmp_path_factory.mktemp("int_ops"), cfg, quiet=True)
    compiled = load_compiled(res.compiled_model)
    bodies = [body_model(sg.graph, list(compiled.model.opset_import), compiled.model.ir_version)
              for sg in compiled.subgraphs if sg.kind == "npu"]
    assert bodies
    return bodies


def test_the_checker_accepts_the_npu_bodies_of_a_compiled_model(npu_bodies):
    ops = set()
    for model in npu_bodies:
        onnx.checker.check_model(model, full_check=True)  # structure, schemas, strict type inference
        inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
        typed = {v.name: v.type.tensor_type.elem_type for v in [*inferred.graph.value_info, *inferred.graph.output]}
        for node in model.graph.node:
            if node.domain == INT_DOMAIN:
                ops.add(node.op_type)
                to = next(a.i for a in node.attribute if a.name == "to")
                assert typed[node.output[0]] == to, node.name
    assert {"QConv", "QAdd", "QMatMul", "QReduceMean"} <= ops


def _first(model: onnx.ModelProto, op_type: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.op_type == op_type)


def _unknown_attribute(m: onnx.ModelProto) -> None:
    _first(m, "QConv").attribute.append(helper.make_attribute("x_zero_point", 0))


def _float_attribute(m: onnx.ModelProto) -> None:
    node = _first(m, "QConv")
    kept = [a for a in node.attribute if a.name != "group"]
    del node.attribute[:]
    node.attribute.extend([*kept, helper.make_attribute("group", 1.0)])


def _missing_to(m: onnx.ModelProto) -> None:
    node = _first(m, "QConv")
    kept = [a for a in node.attribute if a.name != "to"]
    del node.attribute[:]
    node.attribute.extend(kept)


def _extra_input(m: onnx.ModelProto) -> None:  # QConv takes 5 inputs, 6 with the zero points of U4 weights
    node = _first(m, "QConv")
    node.input.extend([node.input[-1]] * (7 - len(node.input)))


def _missing_input(m: onnx.ModelProto) -> None:
    del _first(m, "QAdd").input[1]


def _wrong_to(m: onnx.ModelProto) -> None:
    node = _first(m, "QConv")
    for a in node.attribute:
        if a.name == "to":
            a.i = TensorProto.INT16 if a.i != TensorProto.INT16 else TensorProto.UINT8


def _float_to(m: onnx.ModelProto) -> None:
    for a in _first(m, "QAdd").attribute:
        if a.name == "to":
            a.i = TensorProto.FLOAT


@pytest.mark.parametrize(("damage", "message"), [
    (_unknown_attribute, "Unrecognized attribute: x_zero_point for operator QConv"),
    (_float_attribute, "Mismatched attribute type"),
    (_missing_to, "Required attribute 'to' is missing"),
    (_extra_input, "QConv:1) has input size 7 not in range [min=5, max=6]"),
    (_missing_input, "QAdd:1) has input size 1 not in range [min=2, max=2]"),
    (_wrong_to, "Inferred elem type differs from existing elem type"),
    (_float_to, "attribute 'to' = 1 is not an integer grid type"),
])
def test_the_checker_rejects_a_broken_body(npu_bodies, damage: Callable[[onnx.ModelProto], None], message: str):
    model = copy.deepcopy(next(m for m in npu_bodies if {"QConv", "QAdd"} <= {n.op_type for n in m.graph.node}))
    damage(model)
    with pytest.raises((onnx.checker.ValidationError, onnx.shape_inference.InferenceError)) as err:
        onnx.checker.check_model(model, full_check=True)
    assert message in str(err.value)


def test_every_body_op_has_one_entry_per_stage():
    """An op of NPU bodies is one schema (core, pulsar.int ops only), one cost rule (compiler) and one
    kernel (runtime): the three registries list the same op types."""
    kernels = {op for op, domain in DOMAINS.items() if domain == INT_DOMAIN}
    assert kernels == set(INT_OPS)
    assert set(COST_RULES) == set(KERNELS)
    for op in INT_OPS:
        schema = onnx.defs.get_schema(op, 1, INT_DOMAIN)
        assert schema.domain == INT_DOMAIN and "to" in schema.attributes and schema.attributes["to"].required


def test_an_integer_kernel_needs_its_schema():
    with pytest.raises(ValueError, match="kernel 'QFoo': no pulsar.int schema in pulsar/core/int_ops.py"):
        register("QFoo", domain=INT_DOMAIN)(lambda attrs, consts: lambda inputs: [])
    assert "QFoo" not in KERNELS
