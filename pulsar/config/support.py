"""What this version of pulsar implements, as data.

The schema describes the whole product; a field whose feature is not built yet is *rejected* with a
message naming it when set away from its default, never accepted and silently ignored. Each rule is
removed when its feature lands.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pulsar.config.schema import load_schema, resolve

_NOT_YET = "not supported by this pulsar version yet"


@dataclass(frozen=True)
class Rule:
    path: str  # dotted, with [*] for every list item
    allowed: Callable[[Any, dict[str, Any]], bool]
    why: str
    unavailable: bool = False  # the field's feature is not built yet (marked in --help)


def _default(value: Any, _cfg: dict[str, Any], *, default: Any) -> bool:
    return bool(value == default)


def _at_default(path: str, why: str = _NOT_YET) -> Rule:
    node: dict[str, Any] = load_schema()
    for part in path.replace("[*]", "").split("."):
        node = resolve(node)
        node = node.get("properties", {}).get(part) or resolve(node.get("items", {})).get("properties", {})[part]
    default = resolve(node).get("default")
    def allowed(v: Any, _c: dict[str, Any]) -> bool:
        return v is None or bool(v == default)

    return Rule(path, allowed, why, unavailable=True)


def _needs(path: str, condition: Callable[[dict[str, Any]], bool], why: str) -> Rule:
    """A field that only acts together with another: at its default it is fine, set away from it
    without ``condition`` (on its enclosing section) it would be silently ignored, so it is rejected."""
    default = _at_default(path).allowed

    def allowed(v: Any, section: dict[str, Any]) -> bool:
        return default(v, section) or condition(section)

    return Rule(path, allowed, why)


def _analysis(q: dict[str, Any]) -> bool:
    return bool(q.get("precision_analysis"))


def _finetune(q: dict[str, Any]) -> bool:
    return any(q.get(f) for f in ("enable_adaround", "enable_brecq", "enable_lsq"))


def _multi_batch(c: dict[str, Any]) -> bool:
    entries = [c, *(c.get("sub_configs") or [])]
    return any(e.get("static_batch_sizes") or e.get("max_dynamic_batch_size") for e in entries)


_MULTI = "only used by multi-batch compilation (compiler.static_batch_sizes or max_dynamic_batch_size)"
_FINETUNE = "only used by fine-tuning (quant.enable_adaround, enable_brecq or enable_lsq)"
_AMP = "only used with quant.auto_mixed_precision.enable"

RULES: list[Rule] = [
    Rule("model_type", lambda v, _c: v in ("ONNX", "QuantONNX"),
         "QuantAxModel input (pulsar's own quantized artifact) is not available yet; use ONNX or QuantONNX"),
    _at_default("onnx_opt.save_tensors_data"),
    Rule("onnx_opt.simplifier", lambda v, o: v in (None, "onnxsim") or bool(o.get("enable_onnxsim")),
         "only used with onnx_opt.enable_onnxsim"),
    Rule("quant.precision_analysis_mode", lambda v, q: v == "Reference" or q.get("precision_analysis_method") ==
         "EndToEnd", "NPUBackend runs the whole integer network: use it with precision_analysis_method EndToEnd"),
    Rule("quant.ln_scale_data_type", lambda v, _c: v in ("FP32", "S32"),
         "U32 has no ONNX DequantizeLinear type; use S32 or FP32"),
    Rule("quant.calibration_percentile", lambda v, q: v == 99.99 or q.get("calibration_method") == "Percentile",
         "only used with quant.calibration_method Percentile"),
    Rule("quant.smooth_quant_threshold", lambda v, q: v == 0.2 or bool(q.get("enable_smooth_quant")),
         "only used with quant.enable_smooth_quant"),
    Rule("quant.smooth_quant_strength", lambda v, q: v == 0.6 or bool(q.get("enable_smooth_quant")),
         "only used with quant.enable_smooth_quant"),
    Rule("quant.enable_lsq", lambda v, q: not v or not (q.get("enable_adaround") or q.get("enable_brecq")),
         "LSQ learns the weights and their scales itself, AdaRound / BRECQ learn the rounding of weights on "
         "fixed scales: enable one of them (enable_adaround with enable_brecq runs BRECQ)"),
    *(_needs(f"quant.{f}", _finetune, _FINETUNE) for f in ("finetune_epochs", "finetune_block_size",
                                                           "finetune_batch_size", "finetune_lr")),
    _needs("quant.device", _finetune, _FINETUNE + "; calibration runs in onnxruntime on the CPU"),
    _needs("compiler.disable_ir_fix", _multi_batch, _MULTI),
    Rule("compiler.max_dynamic_batch_size", lambda v, c: not v or not c.get("static_batch_sizes"),
         "static (compiler.static_batch_sizes) and dynamic multi-batch exclude each other; set one of them"),
    Rule("compiler.check_tensor_black_list",
         lambda v, c: not v or bool(c.get("check")) and c.get("check_mode") == "CheckPerLayer",
         "only used by compiler.check 1, 2 or 3 with check_mode CheckPerLayer"),
    # fields that only act together with another one
    _needs("quant.precision_analysis_method", _analysis, "only used with quant.precision_analysis"),
    _needs("quant.precision_analysis_mode", _analysis, "only used with quant.precision_analysis"),
    _needs("quant.input_sample_dir", _analysis, "only used with quant.precision_analysis (its samples)"),
    _needs("quant.ln_scale_data_type", lambda q: (q.get("transformer_opt_level") or 0) >= 1 or bool(
        q.get("layer_configs")), "only used when a LayerNormalization runs on the NPU (quant.transformer_opt_level "
        ">= 1 or a layer_configs entry)"),
    *(_needs(f"quant.auto_mixed_precision.{f}", lambda a: bool(a.get("enable")), _AMP)
      for f in ("max_16bit_layers", "target_cosine", "data_type", "num_samples")),
    _needs("compiler.check_mode", lambda c: bool(c.get("check")), "only used with compiler.check 1, 2 or 3"),
    _needs("compiler.input_sample_dir", lambda c: bool(c.get("check")),
           "only used with compiler.check 1, 2 or 3 (its samples)"),
    _needs("compiler.check_rtol", lambda c: c.get("check") == 1, "only used with compiler.check 1 (all-close)"),
    _needs("compiler.check_atol", lambda c: c.get("check") == 1, "only used with compiler.check 1 (all-close)"),
    _needs("compiler.check_cosine_simularity", lambda c: c.get("check") == 3,
           "only used with compiler.check 3 (cosine)"),
    _needs("input_processors[*].padding_constant_value", lambda p: bool(p.get("padding")),
           "only used with padding"),
    _at_default("compiler.enable_slice_mode"),
    _at_default("compiler.enable_tile_mode"),
    _at_default("compiler.enable_data_soft_compression"),
    # per sub-config, the same not-yet features as at the top level (unset: inherited, accepted)
    *(_at_default(f"compiler.sub_configs[*].{f}", why) for f, why in (
        ("disable_ir_fix", "the IR fix acts on the whole graph before it is split; set compiler.disable_ir_fix"),
        ("enable_slice_mode", _NOT_YET), ("enable_tile_mode", _NOT_YET),
        ("enable_data_soft_compression", _NOT_YET))),
]


def _values(data: Any, parts: list[str], prefix: str, parent: dict[str, Any]) -> Iterator[tuple[str, Any, dict[str, Any]]]:
    if not parts:
        yield prefix, data, parent
        return
    head, rest = parts[0], parts[1:]
    star = head.endswith("[*]")
    key = head[:-3] if star else head
    if not isinstance(data, dict) or key not in data:
        if not star and not rest:
            yield f"{prefix}.{key}".lstrip("."), None, data if isinstance(data, dict) else {}
        return
    value = data[key]
    path = f"{prefix}.{key}".lstrip(".")
    if star:
        for i, item in enumerate(value or []):
            yield from _values(item, rest, f"{path}[{i}]", item)
    else:
        yield from _values(value, rest, path, data)


def unavailable_fields() -> dict[str, str]:
    """Dotted field -> why, for the fields whose feature this version does not have yet."""
    return {r.path: r.why for r in RULES if r.unavailable and "[*]" not in r.path}


def check_supported(config: dict[str, Any]) -> list[str]:
    """One problem line per field set to a value this version cannot honour."""
    problems = []
    for rule in RULES:
        for path, value, parent in _values(config, rule.path.split("."), "", config):
            if not rule.allowed(value, parent):
                shown = json.dumps(value) if not isinstance(value, str) else repr(value)
                problems.append(f"{path}: {shown} is not accepted: {rule.why}; remove the field or leave it at its default")
    return problems
