"""The integer NPU ops (domain ``pulsar.int``, version 1) as ONNX operator schemas.

NPU subgraph bodies of a compiled model are ONNX graphs of these ops plus standard data movement
(docs/integer_semantics.md defines what each computes; the lowering in pulsar/compiler/lower/rules
writes them, the kernels in pulsar/runtime/kernels run them). Importing this module registers the
schemas with onnx (:func:`onnx.defs.register_schema`), so that ``onnx.checker.check_model`` and
``onnx.shape_inference`` check a body like any standard graph: op arity, attribute names and types,
required attributes, element types of inputs, and the output element type, which the attribute
``to`` gives (inference sets it; with ``check_type`` a body's ``value_info`` must agree).

An op of NPU bodies is one entry per stage: its schema here (``pulsar.int`` ops), its cost rule
(``@cost_rule``, pulsar/compiler/workload.py), its kernel (``@register``, pulsar/runtime/kernels), and
a lowering rule that emits it (``@rule``, pulsar/compiler/lower/rules); tests/compiler/test_int_ops.py
checks that the three op registries list the same op types.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx.defs import OpSchema

INT_DOMAIN = "pulsar.int"
INT_VERSION = 1

_ATTR = OpSchema.AttrType
_OPTIONAL = OpSchema.FormalParameterOption.Optional

# Element types, as type constraints (a type variable per input: operands may differ in type).
_NARROW = ("uint8", "int8", "uint16", "int16", "int32")  # activations, weights, intermediates
_WIDE = (*_NARROW, "int64")                               # also a constant on an int64 grid (QAdd)
_INT = ("int32", "int64")                                 # multipliers, shifts, biases, tables
_WEIGHT = ("int4", "uint4", *_NARROW)                     # constant weights: 4-bit ones stored two per byte
OUT_TYPES = {onnx.TensorProto.UINT8, onnx.TensorProto.INT8, onnx.TensorProto.UINT16, onnx.TensorProto.INT16,
             onnx.TensorProto.INT32}
_FLOAT = ("float16", "bfloat16")                          # FP16 / BF16 layers (pulsar/core/float_ops.py)
FLOAT_OUT_TYPES = {onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
_F = _ATTR.FLOAT


@dataclass(frozen=True)
class In:
    name: str
    types: tuple[str, ...]
    optional: bool = False


# Attributes: name -> (type, required). Every op also has the output grid (to, out_zp, out_min, out_max).
_I, _IS = _ATTR.INT, _ATTR.INTS
GRID = {"to": (_I, True), "out_zp": (_I, False), "out_min": (_I, False), "out_max": (_I, False)}
_CONV = {"x_zp": (_I, False), "strides": (_IS, False), "pads": (_IS, False), "dilations": (_IS, False),
         "group": (_I, False)}
_CONV_IN = (In("x", _NARROW), In("w", _WEIGHT), In("bias", _INT, True), In("M", _INT), In("N", _INT),
            In("w_zp", _INT, True))  # w_zp: per output channel, for weights stored affine (U4)

# op type -> (inputs, own attributes, one-line summary)
INT_OPS: dict[str, tuple[tuple[In, ...], dict[str, tuple[OpSchema.AttrType, bool]], str]] = {
    "QConv": (_CONV_IN, _CONV, "integer convolution, requantized per output channel"),
    "QConvTranspose": (_CONV_IN, {**_CONV, "output_padding": (_IS, False)},
                       "integer transposed convolution, requantized per output channel"),
    "QMatMul": ((In("a", _NARROW), In("b", _WEIGHT), In("bias", _INT, True), In("M", _INT), In("N", _INT),
                 In("b_zps", _INT, True)),
                {"a_zp": (_I, False), "b_zp": (_I, False), "trans_b": (_I, False)},
                "integer matrix product, requantized per output column"),
    "QAdd": ((In("a", _NARROW), In("b", _WIDE)),
             {"a_zp": (_I, False), "b_zp": (_I, False), "Ma": (_I, True), "Mb": (_I, True), "N": (_I, True)},
             "sum of two rescaled operands, rounded once"),
    "QMul": ((In("a", _NARROW), In("b", _NARROW), In("M", _INT), In("N", _INT)),
             {"a_zp": (_I, False), "b_zp": (_I, False)}, "product of two centred operands, requantized"),
    "Requantize": ((In("x", _NARROW),), {"x_zp": (_I, False), "M": (_I, False), "N": (_I, False)},
                   "the input moved to the output grid"),
    "QAvgPool": ((In("x", _NARROW), In("M", _INT)),
                 {"x_zp": (_I, False), "N": (_I, True), "kernel_shape": (_IS, True), "strides": (_IS, False),
                  "pads": (_IS, False), "dilations": (_IS, False), "ceil_mode": (_I, False),
                  "count_include_pad": (_I, False)},
                 "window sums requantized by a multiplier table indexed by the element count"),
    "QReduceMean": ((In("x", _NARROW),),
                    {"x_zp": (_I, False), "axes": (_IS, False), "keepdims": (_I, False), "M": (_I, True),
                     "N": (_I, True)},
                    "sums over axes, requantized"),
    "QLut": ((In("x", _NARROW), In("table", _INT)), {"step_bits": (_I, False)},
             "lookup table, interpolated between knots for 16-bit inputs"),
    "QSoftmax": ((In("x", _NARROW), In("table", _INT)),
                 {"axis": (_I, False), "step_bits": (_I, False), "Q": (_I, True), "P": (_I, False)},
                 "softmax from an exponent table and one rounded division"),
    "QLayerNorm": ((In("x", _NARROW), In("gamma", _NARROW, True), In("beta", _INT, True), In("M", _INT),
                    In("N", _INT)),
                   {"axis": (_I, False), "x_zp": (_I, False), "eps_q": (_I, False), "F": (_I, False)},
                   "layer normalization with an exact integer square root"),
    # the border of an FP16 / BF16 layer
    "Dequantize": ((In("x", _WEIGHT), In("scales", ("float",), True), In("zero_points", _INT, True)),
                   {"x_zp": (_I, False), "scale": (_F, False), "axis": (_I, False), "block_size": (_I, False)},
                   "integers to a float format: (x - zero point) * scale in float32, rounded once (`to` is the "
                   "format); per tensor (attributes), per channel along `axis` or per block of `block_size` along it "
                   "(inputs: a weight)"),
    "Quantize": ((In("x", _FLOAT),), {"scale": (_F, True)},
                 "a float format to integers: x / scale in float32, rounded half to even, + out_zp, saturated"),
}
# ops whose output is a float format, not an integer grid
FLOAT_OUTPUT_OPS = {"Dequantize"}


def _output_type(ctx: onnx.shape_inference.InferenceContext) -> None:
    """The output element type is the attribute ``to`` (an integer grid type)."""
    to = ctx.get_attribute("to")
    code = to.i if isinstance(to, onnx.AttributeProto) else None
    if code not in OUT_TYPES | FLOAT_OUT_TYPES:
        raise onnx.shape_inference.InferenceError(
            f"[TypeInferenceError] {ctx.get_display_name()}: attribute 'to' = {code} is not an integer grid type "
            f"{sorted(OUT_TYPES)}")
    out = onnx.TypeProto()
    out.tensor_type.elem_type = code
    ctx.set_output_type(0, out)


def schema(op_type: str) -> OpSchema:
    inputs, attrs, summary = INT_OPS[op_type]
    formal = [OpSchema.FormalParameter(i.name, f"T_{i.name}", param_option=_OPTIONAL if i.optional else
                                       OpSchema.FormalParameterOption.Single) for i in inputs]
    constraints = [(f"T_{i.name}", [f"tensor({t})" for t in i.types], f"element type of {i.name}") for i in inputs]
    attributes = [OpSchema.Attribute(name, kind, required=required)
                  for name, (kind, required) in {**attrs, **GRID}.items()]
    s = OpSchema(op_type, INT_DOMAIN, INT_VERSION, f"{summary} (docs/integer_semantics.md)",
                 inputs=formal, outputs=[OpSchema.FormalParameter("y", "T_y")],
                 type_constraints=[*constraints, ("T_y", [f"tensor({t})" for t in
                                                           (_FLOAT if op_type in FLOAT_OUTPUT_OPS else _NARROW)],
                                                  "the type `to` names")],
                 attributes=attributes)
    s.set_type_and_shape_inference_function(_output_type)
    return s


def register_schemas() -> None:
    """Register every ``pulsar.int`` op with onnx (once per process)."""
    for op_type in INT_OPS:
        if not onnx.defs.has(op_type, INT_DOMAIN):
            onnx.defs.register_schema(schema(op_type))


register_schemas()
