"""Every ONNX op type pulsar knows about, once: the facts about it that no stage owns (issue 26).

One :class:`OpDef` per (domain, op type): what kind of op it is, how pulsar's quantizer classifies it
(active / passive / manual, or not quantized), the roles it plays (a clamp fused into its producer,
an element-wise table, arithmetic with a foldable scalar, a data move ...), and ``cpu_only`` with the
reason when the NPU never runs it. How a stage *implements* the op stays in that stage, keyed by the
same op type, next to its code (the layering: core < quant < compiler < runtime):

=========================  ===========================================================================
quant                      ``pulsar/quant/ops.py`` (OPS: weights, bias, data inputs; the role flags
                           come from here), ``pulsar/quant/torch_exec/ops`` (TORCH_OPS)
compiler                   ``pulsar/compiler/lower/rules`` (RULES / ``find_rule``, LUT_FUNCS),
                           ``pulsar/compiler/workload.py`` (COST_RULES)
runtime                    ``pulsar/runtime/kernels`` (KERNELS)
core                       ``pulsar/core/int_ops.py`` (the ``pulsar.int`` ops lowering rules emit)
=========================  ===========================================================================

``tests/test_opdefs.py`` checks each stage's table against this registry: every op a stage knows is
defined here, and every op the NPU may run (not ``cpu_only``) has all of its pieces, or names the one it
lacks in ``lacks`` with the reason, so that half an op fails the test.

Three facts are easily confused, and were three disagreeing "passive" lists before this module:

- ``role="passive"`` (the quantizer): the output *shares input 0's scale*, no requantization
  (Reshape, MaxPool, ...). A decision of pulsar's quantizer, so only for ops it quantizes.
- ``keeps_grid``: every output code is one of input 0's codes, so an integer output is on input 0's
  grid (what the runtime check uses to compare tensors of NPU bodies). Every passive op keeps the
  grid; so do ops pulsar does not make passive: Resize (nearest, the only mode the NPU runs; pulsar
  quantizes Resize as active since other modes interpolate), Gather / Expand / Tile (not quantized by
  pulsar, lowered for imported QDQ models) and ReduceMax (manual).
- ``moves_codes``: the compiler lowers the op as the standard ONNX op on integer codes, Requantize
  where grids differ (the runtime needs a standard-domain kernel and the cost model a rule): the
  grid keepers and Concat (several inputs, each requantized to the output grid).

Where the views replaced hand-written sets they equal them, except (deliberately):

- the runtime check's grid keepers gain GlobalMaxPool and ReduceMax: a maximum of codes is a code, as
  for MaxPool, which was already one;
- the attention-mask recogniser's "compute" ops (never in a mask branch) are every op of kind conv /
  matmul / attention / normalization / softmax plus the GELUs: FastGelu, the integer / QOperator
  products, DeformConv, the other normalizations and fused attention ops join (they compute on data
  exactly as the MatMul / LayerNormalization / Gelu of the old list did);
- its indexing ops (kind gather) gain Compress and ArrayFeatureExtractor, which read input 0 at run-time
  positions as Gather does (an embedding-like lookup when input 0 is a learned table).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

Role = Literal["active", "passive", "manual"]
Piece = Literal["quant", "torch", "lower"]
Kind = Literal[
    "conv", "matmul", "attention", "normalization", "softmax", "activation", "elementwise", "logic",
    "select", "reduce", "pool", "movement", "cast", "gather", "scatter", "shape", "generator", "constant",
    "quantization", "recurrent", "control", "signal", "vision", "loss", "text", "other",
]
PIECES: tuple[Piece, ...] = ("quant", "torch", "lower")

DEFAULT = ""
MS = "com.microsoft"
ML = "ai.onnx.ml"


@dataclass(frozen=True)
class OpDef:
    """What pulsar knows about one op type, whatever the stage."""

    op_type: str
    domain: str
    kind: Kind                      # what it computes (a coarse family)
    role: Role | None = None        # how pulsar's quantizer classifies it; None: not quantized (float)
    fused_activation: bool = False  # a clamp (Relu / Clip) computed inside its producer's requantization
    absorbs_activation: bool = False  # its requantization can compute a following fused activation
    lut: bool = False               # y = f(x) element by element, f fixed by attributes / scalar bounds: a table
    lut_scalar_operand: bool = False  # a table when its operand 1 is a scalar constant (PRelu slope, Pow exponent)
    scalar_at: tuple[int, ...] = ()   # inputs where a float scalar constant makes it a function of one tensor
    mixed_precision: bool = False   # computes: a candidate of the auto mixed-precision search
    moves_codes: bool = False       # lowered as the standard ONNX op on integer codes (see the module docstring)
    keeps_grid: bool = False        # every output code is one of input 0's codes: same grid
    enlarges: bool = False          # copies input elements, usually writing more than it reads (Resize, Expand, Tile)
    shape_only: bool = False        # changes only shape, axis order, broadcast or element type of input 0
    same_values: bool = False       # output 0 holds input 0's values, each exactly once (a permutation)
    keeps_order: bool = False       # ... and in the same flat (C) order: a reshape
    float_layer: bool = False       # runs in an FP16 / BF16 layer on the NPU (pulsar/core/float_ops.py)
    cpu_only: str = ""              # why the NPU never runs it ("": it can)
    lacks: tuple[tuple[Piece, str], ...] = ()  # pieces an NPU op has not got, each with why

    @property
    def name(self) -> str:
        return f"{self.domain or 'ai.onnx'}:{self.op_type}"

    def lacking(self, piece: Piece) -> str:
        """Why this op has no ``piece`` ("" when it should have one)."""
        return dict(self.lacks).get(piece, "")


OPDEFS: dict[tuple[str, str], OpDef] = {}


def define(*op_types: str, kind: Kind, domain: str = DEFAULT, lacks: dict[Piece, str] | None = None,
           **facts: Any) -> None:
    """Add one :class:`OpDef` per op type (same facts for all)."""
    for op in op_types:
        key = (domain, op)
        if key in OPDEFS:
            raise ValueError(f"op {domain or 'ai.onnx'}:{op} defined twice")
        OPDEFS[key] = OpDef(op, domain, kind, lacks=tuple((lacks or {}).items()), **facts)


def lookup(op_type: str, domain: str = DEFAULT) -> OpDef | None:
    """The definition of ``domain:op_type`` ("ai.onnx" counts as the default domain)."""
    return OPDEFS.get(("" if domain == "ai.onnx" else domain, op_type))


def by_type(op_type: str) -> OpDef | None:
    """The definition of ``op_type`` for tables keyed by op type alone (the default domain first)."""
    found = lookup(op_type)
    if found is not None:
        return found
    return next((d for d in OPDEFS.values() if d.op_type == op_type), None)


def op_types(where: Callable[[OpDef], bool]) -> frozenset[str]:
    """Op types (any domain) whose definition satisfies ``where``."""
    return frozenset(d.op_type for d in OPDEFS.values() if where(d))


# --------------------------------------------------------------------------- why an op stays on the CPU

_NOT_QUANTIZED = ("pulsar's quantizer has no rule for it, so a build from a float model keeps it in float on the "
                  "CPU; an imported QDQ model (model_type QuantONNX) that quantizes it runs it on the NPU")
_LOGIC = "comparison, logic or bits: boolean / integer data has no quantization grid"
_CAST = "changes the element type: an integer tensor's grid does not survive it"
_SHAPE = "computes shapes, sizes or indices (integer tensors): the frontend folds it or the CPU runs it"
_DYNAMIC = "its output shape depends on the data; NPU programs have static shapes"
_CONTROL = "control flow / optional values: subgraphs run on the CPU"
_RECURRENT = "a recurrent layer (state carried across time steps): no integer lowering"
_SIGNAL = "spectral transform or window generation: no integer lowering"
_QDQ = ("the QDQ format's own conversion: the compiler turns Q / DQ pairs into integer tensors and their grids; "
        "one left over runs on the CPU")
_QOPERATOR = "onnxruntime's operator-oriented quantization (QOperator): pulsar reads QDQ models"
_TRAINING = "a training-time op (the frontend removes Dropout for inference)"
_VISION = "samples at computed coordinates, regions or indices (detection / warping heads): no integer lowering"
_TEXT = "text features (integer n-grams): no quantization grid"


def _later(what: str) -> str:
    return f"no integer lowering yet{f' ({what})' if what else ''}"


# --------------------------------------------------------------------------- the ops the NPU runs

# Active: quantized with their own output scale.
define("Conv", "ConvTranspose", kind="conv", role="active", absorbs_activation=True, mixed_precision=True)
define("Gemm", "MatMul", kind="matmul", role="active", absorbs_activation=True, mixed_precision=True)
define("Add", "Mul", kind="elementwise", role="active", absorbs_activation=True, scalar_at=(0, 1),
       mixed_precision=True)
define("Sub", kind="elementwise", role="active", absorbs_activation=True, scalar_at=(1,), mixed_precision=True)
define("Concat", kind="movement", role="active", moves_codes=True, mixed_precision=True)
define("Relu", "Clip", kind="activation", role="active", fused_activation=True, lut=True)
define("LeakyRelu", "Elu", kind="activation", role="active", lut=True)
define("Sigmoid", "HardSigmoid", "HardSwish", "Tanh", kind="activation", role="active", lut=True,
       mixed_precision=True)
define("PRelu", kind="activation", role="active", lut_scalar_operand=True)
define("Neg", kind="elementwise", role="active", lut=True)
define("AveragePool", "GlobalAveragePool", kind="pool", role="active", mixed_precision=True)
define("Resize", kind="movement", role="active", mixed_precision=True, moves_codes=True, keeps_grid=True,
       enlarges=True)

# Passive: no arithmetic; they share their input's scale, run on the NPU next to quantized neighbours
# and on the CPU next to float ones.
define("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", kind="movement", role="passive",
       moves_codes=True, keeps_grid=True, shape_only=True, same_values=True, keeps_order=True)
define("Transpose", kind="movement", role="passive", moves_codes=True, keeps_grid=True, shape_only=True,
       same_values=True)
define("DepthToSpace", "SpaceToDepth", kind="movement", role="passive", moves_codes=True, keeps_grid=True,
       same_values=True)
define("Slice", "Split", "Pad", kind="movement", role="passive", moves_codes=True, keeps_grid=True)
define("MaxPool", "GlobalMaxPool", kind="pool", role="passive", moves_codes=True, keeps_grid=True)

# Manual: the NPU can run them, but at 8 bits they usually cost accuracy (exponentials, normalizations,
# divisions), so they stay on the CPU in float unless a layer_configs entry selects them.
define("Softmax", kind="softmax", role="manual")
define("LayerNormalization", kind="normalization", role="manual")
define("Gelu", kind="activation", role="manual", lut=True)
define("Gelu", "FastGelu", domain=MS, kind="activation", role="manual", lut=True)
define("Exp", "Log", "Sqrt", "Reciprocal", "Erf", kind="elementwise", role="manual", lut=True)
define("Pow", kind="elementwise", role="manual", lut_scalar_operand=True)
define("Div", kind="elementwise", role="manual", scalar_at=(1,))
define("ReduceMean", "ReduceSum", kind="reduce", role="manual")
define("ReduceMax", kind="reduce", role="manual", moves_codes=True, keeps_grid=True)
define("InstanceNormalization", kind="normalization", role="manual",
       cpu_only=_later("a layer_configs entry quantizes it, the compiler keeps it on the CPU"))
define("ReduceMin", kind="reduce", role="manual",
       cpu_only=_later("ReduceMax's passive lowering and kernel would do: the minimum of codes is a code"))

# Lowered (for imported QDQ models) but not quantized by pulsar's own quantizer.
define("Gather", kind="gather", moves_codes=True, keeps_grid=True, lacks={"quant": _NOT_QUANTIZED})
define("Expand", kind="movement", moves_codes=True, keeps_grid=True, enlarges=True, shape_only=True,
       lacks={"quant": _NOT_QUANTIZED})
define("Tile", kind="movement", moves_codes=True, keeps_grid=True, enlarges=True, lacks={"quant": _NOT_QUANTIZED})
define("Selu", "Celu", "Softplus", "Softsign", "ThresholdedRelu", "Shrink", "Mish", kind="activation", lut=True,
       lacks={"quant": _NOT_QUANTIZED})
define("QuickGelu", domain=MS, kind="activation", lut=True, lacks={"quant": _NOT_QUANTIZED})
define("Abs", "Sin", "Cos", "Atan", "Floor", "Ceil", "Round", "Sign", kind="elementwise", lut=True,
       lacks={"quant": _NOT_QUANTIZED})

# A value, not a computation.
define("Constant", kind="constant", lacks={
    "quant": "a value: its readers quantize it as a constant operand",
    "torch": "the torch executor folds Constant nodes into values",
    "lower": "the compiler folds Constant nodes into initializers; the simulator's Constant kernel runs one "
             "that an NPU body still holds",
})

# --------------------------------------------------------------------------- ops the NPU never runs

define("ConvInteger", "QLinearConv", kind="conv", cpu_only=_QOPERATOR)
define("MatMulInteger", "QLinearMatMul", kind="matmul", cpu_only=_QOPERATOR)
define("DeformConv", kind="conv", cpu_only=_VISION)
define("CausalConvWithState", kind="conv", cpu_only=_RECURRENT)
define("Einsum", kind="matmul", cpu_only=_later("MatMul / Gemm have one"))
define("Attention", "RotaryEmbedding", "LinearAttention", kind="attention",
       cpu_only=_later("a fused transformer op; its MatMul / Softmax pieces have one"))
define("Attention", "MultiHeadAttention", "RotaryEmbedding", domain=MS, kind="attention",
       cpu_only=_later("a fused transformer op; its MatMul / Softmax pieces have one"))
define("BatchNormalization", kind="normalization",
       cpu_only=_later("the frontend folds it into the Conv before it; a standalone one stays on the CPU"))
define("GroupNormalization", "RMSNormalization", "LpNormalization", "MeanVarianceNormalization", "LRN",
       kind="normalization", cpu_only=_later("LayerNormalization has one"))
define("LogSoftmax", kind="softmax", cpu_only=_later("Softmax has one"))
define("BiasGelu", domain=MS, kind="activation", cpu_only=_later("Gelu / FastGelu have one"))
define("Swish", kind="activation", cpu_only=_later("an element-wise function: a LUT_FUNCS entry would make it a table"))
define("Tan", "Asin", "Acos", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh", kind="elementwise",
       cpu_only=_later("an element-wise function: a LUT_FUNCS entry would make it a table"))
define("Max", "Min", "Sum", "Mean", "Mod", kind="elementwise", cpu_only=_later("element-wise over several tensors"))
define("CumSum", "CumProd", kind="elementwise", cpu_only=_later("a running sum / product along an axis"))
define("Det", kind="other", cpu_only=_later("a determinant"))
define("ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare", kind="reduce",
       cpu_only=_later("ReduceMean / ReduceSum / ReduceMax have one"))
define("ArgMax", "ArgMin", "Hardmax", kind="reduce", cpu_only=_SHAPE)
define("LpPool", "GlobalLpPool", kind="pool", cpu_only=_later("Lp pooling"))
define("MaxUnpool", "MaxRoiPool", kind="pool", cpu_only=_VISION)
define("Upsample", kind="movement", cpu_only=_later("deprecated since opset 10: Resize replaces it"))
define("ReverseSequence", "CenterCropPad", "Trilu", kind="movement", cpu_only=_later(""))
define("Cast", kind="cast", shape_only=True, cpu_only=_CAST)
define("CastLike", "BitCast", kind="cast", cpu_only=_CAST)
define("GatherElements", "GatherND", kind="gather", cpu_only=_later("Gather has one"))
define("ArrayFeatureExtractor", domain=ML, kind="gather", cpu_only=_later("Gather has one"))
define("Compress", kind="gather", cpu_only=_DYNAMIC)
define("ScatterElements", "Scatter", "ScatterND", "TensorScatter", kind="scatter",
       cpu_only=_later("writes at run-time indices"))
define("Where", kind="select", cpu_only=_later("a selection by a boolean condition"))
define("Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "And", "Or", "Xor", "Not", "BitwiseAnd",
       "BitwiseOr", "BitwiseXor", "BitwiseNot", "BitShift", "IsInf", "IsNaN", kind="logic", cpu_only=_LOGIC)
define("Binarizer", domain=ML, kind="logic", cpu_only=_LOGIC)
define("Shape", "Size", "OneHot", "TopK", kind="shape", cpu_only=_SHAPE)
define("NonZero", "Unique", kind="shape", cpu_only=_DYNAMIC)
define("Range", "ConstantOfShape", "EyeLike", kind="generator", cpu_only=_SHAPE)
define("HannWindow", "HammingWindow", "BlackmanWindow", "MelWeightMatrix", kind="generator", cpu_only=_SIGNAL)
define("DFT", "STFT", kind="signal", cpu_only=_SIGNAL)
define("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", kind="quantization", cpu_only=_QDQ)
define("LSTM", "GRU", "RNN", kind="recurrent", cpu_only=_RECURRENT)
define("If", "Loop", "Scan", "OptionalHasElement", "OptionalGetElement", kind="control", cpu_only=_CONTROL)
define("GridSample", "AffineGrid", "RoiAlign", "NonMaxSuppression", "Col2Im", kind="vision", cpu_only=_VISION)
define("NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss", kind="loss", cpu_only=_TRAINING)
define("Dropout", kind="other", cpu_only=_TRAINING)
define("TfIdfVectorizer", kind="text", cpu_only=_TEXT)


# --------------------------------------------------------------------------- views, by the question they answer


def quantized_ops() -> frozenset[str]:
    """Ops pulsar's quantizer has a rule for (active, passive or manual)."""
    return op_types(lambda d: d.role is not None)


def passive_ops() -> frozenset[str]:
    """Ops whose outputs share input 0's scale (OVERLAPPED): the quantizer's passive class."""
    return op_types(lambda d: d.role == "passive")


def manual_ops() -> frozenset[str]:
    """Ops on the NPU only when a layer_configs entry asks."""
    return op_types(lambda d: d.role == "manual")


def fused_activations() -> frozenset[str]:
    """Clamps (Relu, Clip) the producer's requantization computes: the quantizer quantizes only their
    output, the compiler folds them into the producer's out_min / out_max (or lowers a standalone one
    as a Requantize, not a table)."""
    return op_types(lambda d: d.fused_activation)


def lut_chain_ops() -> frozenset[str]:
    """Active element-wise table ops: a chain of them (and of arithmetic with a scalar) is one table, so
    the quantizer quantizes only the chain's output. Manual table ops (Exp, Gelu ...) are left out: a
    chain through one would quantize what layer_configs keeps in float; PRelu / Pow are tables only
    with a scalar operand."""
    return op_types(lambda d: d.lut and d.role == "active")


def table_ops() -> frozenset[tuple[str, str]]:
    """(domain, op type) of every op the compiler can lower as one lookup table (its LUT_FUNCS)."""
    return frozenset((d.domain, d.op_type) for d in OPDEFS.values() if d.lut or d.lut_scalar_operand)


def scalar_operands() -> dict[str, tuple[int, ...]]:
    """Op type -> the inputs where a float scalar constant folds into the requantization or a table."""
    return {d.op_type: d.scalar_at for d in OPDEFS.values() if d.scalar_at}


def scalar_arithmetic_ops() -> frozenset[str]:
    """Add / Sub / Mul / Div: arithmetic whose second operand may be a scalar (scaling, bias, masks)."""
    return op_types(lambda d: bool(d.scalar_at))


def mixed_precision_ops() -> frozenset[str]:
    """Ops the auto mixed-precision search may raise to 16 bits (those that compute)."""
    return op_types(lambda d: d.mixed_precision)


def code_moving_ops() -> frozenset[str]:
    """Ops the compiler lowers as the standard ONNX op on integer codes (see the module docstring)."""
    return op_types(lambda d: d.moves_codes)


def grid_keeping_ops() -> frozenset[str]:
    """Ops whose integer output is on input 0's grid (see the module docstring)."""
    return op_types(lambda d: d.keeps_grid)


def enlarging_ops() -> frozenset[str]:
    """Resize, Expand, Tile: the compiler requantizes their (smaller) input rather than their output.
    Pad is not one: its new elements are a constant on the input grid, not copies."""
    return op_types(lambda d: d.enlarges)


def same_value_ops() -> frozenset[str]:
    """Reshape, Flatten, Squeeze, Unsqueeze, Transpose, Identity, DepthToSpace, SpaceToDepth: output 0 is
    a permutation of input 0 (every element once, none added), so any statistic of all its values
    (extremes, histogram, zero count) equals the input's; calibration copies it instead of measuring it
    again."""
    return op_types(lambda d: d.same_values)


def order_keeping_ops() -> frozenset[str]:
    """Reshape, Flatten, Squeeze, Unsqueeze, Identity: output 0 is input 0's values in the same flat
    order, so even a statistic of every k-th value (a sampled histogram) equals the input's."""
    return op_types(lambda d: d.keeps_order)


def shape_only_ops() -> frozenset[str]:
    """Reshape, Flatten, Squeeze, Unsqueeze, Identity (shape), Transpose (axis order), Expand (broadcast)
    and Cast (element type): every output element is an input element and the elements along each axis
    keep their order (unlike Slice / Gather, which select, or DepthToSpace / Tile, which reorder)."""
    return op_types(lambda d: d.shape_only)


# Ops an FP16 / BF16 layer runs on the NPU: a float kernel (pulsar/runtime/kernels/floating.py) or
# data movement, which does not care about the element type.
for _op in ("Add", "Sub", "Mul", "Div", "MatMul", "Gemm", "Softmax", "LayerNormalization", "Gelu", "Erf", "Tanh",
            "Sigmoid", "Relu", "Exp", "Sqrt", "Pow", "ReduceMean", "Neg", "Abs", "Reshape", "Transpose", "Squeeze",
            "Unsqueeze", "Flatten", "Concat", "Slice", "Identity"):
    OPDEFS[(DEFAULT, _op)] = replace(OPDEFS[(DEFAULT, _op)], float_layer=True)


def float_layer_ops() -> frozenset[str]:
    """Standard ops an FP16 / BF16 layer runs on the NPU."""
    return op_types(lambda d: d.float_layer and d.domain == DEFAULT)


def kind_ops(*kinds: Kind) -> frozenset[str]:
    """Op types of the given kinds."""
    return op_types(lambda d: d.kind in kinds)


def npu_manual_nonlinearities() -> frozenset[str]:
    """Manual normalizations, softmaxes and activations the NPU can run: LayerNormalization, Softmax and
    the GELUs, the nonlinear ops of a transformer block. Plain math (Exp, Sqrt, Div: the pieces of a
    decomposed one) is not among them."""
    return op_types(lambda d: d.role == "manual" and not d.cpu_only
                    and d.kind in ("normalization", "softmax", "activation"))


__all__ = ["DEFAULT", "ML", "MS", "OPDEFS", "PIECES", "Kind", "OpDef", "Piece", "Role", "by_type",
           "code_moving_ops", "define", "enlarging_ops", "float_layer_ops", "fused_activations", "grid_keeping_ops", "kind_ops",
           "lookup", "lut_chain_ops", "manual_ops", "mixed_precision_ops", "npu_manual_nonlinearities", "op_types",
           "order_keeping_ops", "passive_ops", "quantized_ops", "same_value_ops", "scalar_arithmetic_ops", "scalar_operands", "shape_only_ops",
           "table_ops"]
