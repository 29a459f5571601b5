"""The op registry (pulsar/core/opdefs.py) against every stage's op table.

Every op a stage knows (a quant rule, a torch function, a lowering rule, a table function, a kernel, a
cost rule) is defined in the registry; every op the NPU may run (not ``cpu_only``) has a quant rule, a
torch function and a lowering rule, or names the piece it lacks and why; every integer op a lowering
rule emits has a schema (and so, by tests/compiler/test_int_ops.py, one kernel and one cost rule); the
data-movement ops the compiler copies into NPU bodies have a standard-domain kernel and cost rule. A
half-added op fails here, and so does a stale ``lacks`` entry."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import pulsar
from pulsar.compiler.lower import placement
from pulsar.compiler.lower.rules import PASSIVE_OPS, RULES, lut
from pulsar.compiler.workload import COST_RULES
from pulsar.core import opdefs
from pulsar.core.container import load_compiled
from pulsar.core.int_ops import INT_DOMAIN, INT_OPS
from pulsar.core.opdefs import OPDEFS
from pulsar.quant import attention, ops, transformer
from pulsar.quant.torch_exec.ops import TORCH_OPS
from pulsar.runtime import check
from pulsar.runtime.kernels import DOMAINS

RULES_DIR = Path(lut.__file__).parent


def _defined(op_type: str) -> bool:
    return opdefs.by_type(op_type) is not None


def test_every_op_a_stage_knows_is_defined() -> None:
    missing = [f"quant rule {op}" for op in ops.OPS if not _defined(op)]
    missing += [f"quant weights / data inputs {op}" for op in ops._PARTS if op not in ops.OPS]
    missing += [f"torch function {op}" for op in TORCH_OPS if not _defined(op)]
    missing += [f"lowering rule {d or 'ai.onnx'}:{op}" for d, op in RULES if (d, op) not in OPDEFS]
    missing += [f"table function {d or 'ai.onnx'}:{op}" for d, op in lut.LUT_FUNCS if (d, op) not in OPDEFS]
    missing += [f"kernel {op}" for op, d in DOMAINS.items() if d != INT_DOMAIN and not _defined(op)]
    missing += [f"cost rule {op}" for op in COST_RULES if op not in INT_OPS and not _defined(op)]
    assert not missing, "not in pulsar/core/opdefs.py:\n" + "\n".join(missing)


def test_every_npu_op_has_its_pieces_or_says_which_it_lacks() -> None:
    have = {"quant": lambda d: d.op_type in ops.OPS, "torch": lambda d: d.op_type in TORCH_OPS,
            "lower": lambda d: (d.domain, d.op_type) in RULES}
    bad = []
    for d in OPDEFS.values():
        if d.cpu_only:
            continue
        for piece in opdefs.PIECES:
            if have[piece](d) and d.lacking(piece):
                bad.append(f"{d.name} has a {piece} piece: remove its lacks entry")
            elif not have[piece](d) and not d.lacking(piece):
                bad.append(f"{d.name} has no {piece} piece: add it, or say why in lacks (or cpu_only)")
        if d.moves_codes and not (DOMAINS.get(d.op_type) == "" and d.op_type in COST_RULES):
            bad.append(f"{d.name} is lowered as data movement but has no standard-domain kernel / cost rule")
    assert not bad, "\n".join(bad)


def test_cpu_only_ops_say_why_and_have_no_npu_pieces() -> None:
    bad = []
    for d in OPDEFS.values():
        if not d.cpu_only:
            continue
        if (d.domain, d.op_type) in RULES:
            bad.append(f"{d.name} has a lowering rule: it is not cpu_only")
        if d.lacks or d.moves_codes or d.lut or d.lut_scalar_operand:
            bad.append(f"{d.name} is cpu_only: lacks / moves_codes / lut mean nothing for it")
    assert not bad, "\n".join(bad)


def test_lookup_tables_are_the_registry_table_ops() -> None:
    assert set(lut.LUT_FUNCS) == opdefs.table_ops()


def _emitted(path: Path) -> list[tuple[int, str]]:
    """(line, op type) of every ``*.emit("Op", ...)`` of the pulsar.int domain (no ``domain=``) in a file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "emit" \
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str) \
                and not any(k.arg == "domain" for k in node.keywords):
            out.append((node.lineno, node.args[0].value))
    return out


def test_every_integer_op_a_lowering_emits_has_a_schema() -> None:
    found = {f"{p.name}:{line}: {op}" for p in sorted(RULES_DIR.glob("*.py")) for line, op in _emitted(p)
             if op not in INT_OPS}
    emitted = {op for p in RULES_DIR.glob("*.py") for _, op in _emitted(p)}
    assert {"QConv", "QLut", "Requantize", "QSoftmax"} <= emitted  # the scan sees the rules
    assert not found, "emitted pulsar.int ops without a schema in pulsar/core/int_ops.py:\n" + "\n".join(sorted(found))


def test_flags_agree_with_each_other() -> None:
    bad = []
    for d in OPDEFS.values():
        rules = {
            "passive ops keep their input's grid": d.role != "passive" or d.keeps_grid,
            "grid keepers are lowered as data movement": not d.keeps_grid or d.moves_codes,
            "enlarging ops keep their input's grid": not d.enlarges or d.keeps_grid,
            "a fused activation is an active table op": not d.fused_activation or (d.lut and d.role == "active"),
            "only active ops absorb an activation": not d.absorbs_activation or d.role == "active",
            "mixed precision is for quantized ops": not d.mixed_precision or d.role is not None,
            "a scalar operand folds only in quantized arithmetic": not d.scalar_at or d.role is not None,
            "lut and lut_scalar_operand exclude each other": not (d.lut and d.lut_scalar_operand),
        }
        bad += [f"{d.name}: {why}" for why, ok in rules.items() if not ok]
    by_type: dict[str, list[opdefs.OpDef]] = {}
    for d in OPDEFS.values():
        by_type.setdefault(d.op_type, []).append(d)
    for op, defs in by_type.items():  # the quantizer keys by op type: its domains must agree
        facts = {(d.role, d.lut, d.fused_activation, d.absorbs_activation, d.scalar_at, d.mixed_precision)
                 for d in defs if d.role is not None}
        if len(facts) > 1:
            bad.append(f"{op}: its domains disagree on the quant facts {facts}")
    assert not bad, "\n".join(bad)


def test_stage_tables_are_views_of_the_registry() -> None:
    """No stage keeps its own list of op types: each is the registry's (kept the same or, where listed in
    pulsar/core/opdefs.py, corrected)."""
    assert set(ops.OPS) == opdefs.quantized_ops()
    assert set(ops.MANUAL_OPS) == opdefs.manual_ops()
    assert {op for op, r in ops.OPS.items() if r.passive} == opdefs.passive_ops()
    assert ops.FUSED_ACTIVATIONS == opdefs.fused_activations() == placement._FUSABLE == {"Relu", "Clip"}
    assert opdefs.lut_chain_ops() == ops.UNARY_LUT_OPS
    assert opdefs.scalar_operands() == ops.SCALAR_ARITHMETIC
    assert lut.SCALAR_OPS == opdefs.scalar_arithmetic_ops() == {"Add", "Sub", "Mul", "Div"}
    assert opdefs.mixed_precision_ops() == ops.COMPUTE_OPS
    assert {"Conv", "ConvTranspose", "Gemm", "MatMul"} == ops.WEIGHTED_OPS
    assert PASSIVE_OPS == opdefs.code_moving_ops() == opdefs.grid_keeping_ops() | {"Concat"}
    assert check._MOVES == opdefs.grid_keeping_ops() >= opdefs.passive_ops()
    assert {"LayerNormalization", "Softmax", "Gelu", "FastGelu"} == transformer.TRANSFORMER_NORM_OPS
    assert {"MatMul", "Gemm"} == transformer.PRODUCT_OPS
    assert {"Softmax", "LogSoftmax"} == attention.SOFTMAX_OPS
    assert {"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Identity", "Flatten", "Expand", "Cast"} \
        == attention.SHAPE_OPS


def _neg_model(path: Path) -> Path:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((8, 8)) * 0.3).astype(np.float32), "w1"),
             numpy_helper.from_array((rng.standard_normal((8, 8)) * 0.3).astype(np.float32), "w2")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Neg", ["h"], ["n"], name="neg"),
             helper.make_node("MatMul", ["n", "w2"], ["y"], name="mm2")]
    graph = helper.make_graph(nodes, "neg", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 8])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_an_op_added_in_the_registry_runs_on_the_npu(tmp_path: Path) -> None:
    """Neg became an NPU op by its registry entry alone (role active: the quantizer quantizes it, the
    compiler's table lowering and the torch function were there); compiler.check 1 holds it to the
    float QDQ reference."""
    calib = tmp_path / "calib"
    calib.mkdir()
    for i in range(4):
        np.save(calib / f"{i}.npy", np.random.default_rng(i).standard_normal((1, 8, 8)).astype(np.float32))
    cfg = {"quant": {"input_configs": [{"tensor_name": "x", "calibration_dataset": str(calib),
                                        "calibration_format": "Numpy"}]}}
    res = pulsar.build(_neg_model(tmp_path / "neg.onnx"), tmp_path / "out", cfg, {"compiler.check": 1}, quiet=True)
    nodes = json.loads(res.quant_config.read_text())["nodes"]
    assert nodes["neg"]["placement"] == "NPU", nodes["neg"]
    compiled = load_compiled(res.compiled_model)
    body_ops = {(n.name, n.op_type) for sg in compiled.subgraphs if sg.kind == "npu" for n in sg.graph.node}
    assert ("neg", "QLut") in body_ops, sorted(body_ops)
